// NVIDIA's NRI plugin (nvidia-container-toolkit) as a process of its own, for the real nodes.
module vramshare.io/e2e/tools/nvidia-cdi-nri

go 1.26.0

require github.com/NVIDIA/nvidia-container-toolkit v1.20.2

require (
	github.com/containerd/log v0.1.0 // indirect
	github.com/containerd/nri v0.12.5 // indirect
	github.com/containerd/ttrpc v1.2.7 // indirect
	github.com/knqyf263/go-plugin v0.9.0 // indirect
	github.com/opencontainers/runtime-spec v1.3.0 // indirect
	github.com/sirupsen/logrus v1.9.4 // indirect
	github.com/tetratelabs/wazero v1.11.0 // indirect
	golang.org/x/sys v0.49.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20261104224025-d1e00e9f33ab // indirect
	google.golang.org/grpc v1.83.2 // indirect
	google.golang.org/protobuf v1.36.12 // indirect
)
