// Pins the NVML header the mock library (mock_nvml.c) is compiled against: NVIDIA's nvml.h as go-nvml
// ships it. Nothing here is Go code; e2e/tools/build.sh reads the module's folder.
module vramshare.io/e2e/tools/mock-nvml

go 1.26.0

require github.com/NVIDIA/go-nvml v0.13.4-1
