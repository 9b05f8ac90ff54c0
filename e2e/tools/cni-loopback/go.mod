// A CNI plugin for the local cluster's real nodes: it gives a pod its own loopback address as its
// IP, and no other interface, so containers run with a network namespace of their own and nothing
// they do can reach any address but loopback. Chained after the reference `loopback` plugin.
module vramshare.io/e2e/tools/cni-loopback

go 1.26.0
