"""A real local control plane for vramshare's tests and demo: etcd, kube-apiserver, scheduler,
controller-manager, kwok, a fake DCGM exporter and Prometheus, all on loopback."""
