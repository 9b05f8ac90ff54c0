// The node's sandbox (pause) image's one binary, built static (CGO_ENABLED=0): nothing can be pulled
// here, so registry.k8s.io/pause is made locally. Same job as Kubernetes' build/pause/linux/pause.c:
// hold the pod's namespaces, reap orphaned children, exit on SIGINT/SIGTERM.
module vramshare.io/e2e/tools/pause

go 1.26.0
