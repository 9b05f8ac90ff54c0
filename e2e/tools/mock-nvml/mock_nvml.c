// A mock libnvidia-ml.so.1 for the real nodes of the local cluster, built against NVIDIA's own nvml.h
// (go-nvml's copy): the subset of NVML that NVIDIA's device plugin and nvidia-ml-py's UUID lookup call.
//
// NVIDIA publishes a fuller mock (k8s-test-infra, pkg/gpu/mocknvml), but the Go module proxy does not
// serve that module, and CI builds every tool from what it serves (see e2e/tools/build.sh).
//
// GPUs are files, as the real driver's are device nodes: $VRAMSHARE_MOCK_NVML_ROOT (default
// /run/vramshare-mock-nvml) holds one file per GPU, named by its index, of `key=value` lines
// (uuid, name, memory_mib, minor, bus). The device plugin on the host sees every file; a container is
// given only the files of the GPUs it was allocated (CDI mounts them), so NVML inside it enumerates its
// own GPUs only, as the real library does with the device nodes a container is given.
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nvml.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_GPUS 16

struct nvmlDevice_st {
  unsigned int index;
  unsigned int minor;
  unsigned int bus;
  unsigned long long memory_bytes;
  char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
  char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
};

struct nvmlEventSet_st {
  int unused;
};

static struct nvmlDevice_st gpus[MAX_GPUS];
static unsigned int gpu_count;
static int initialised;
static struct nvmlEventSet_st event_set;

static int by_index(const void *a, const void *b) {
  const struct nvmlDevice_st *x = a, *y = b;
  return (int)x->index - (int)y->index;
}

static void copy_value(char *dst, size_t size, const char *value) {
  snprintf(dst, size, "%s", value);
  dst[strcspn(dst, "\r\n")] = '\0';
}

static int read_gpu(const char *path, unsigned int index, struct nvmlDevice_st *gpu) {
  FILE *f = fopen(path, "r");
  if (f == NULL) return 0;
  memset(gpu, 0, sizeof(*gpu));
  gpu->index = index;
  gpu->minor = index;
  gpu->bus = index + 1;
  copy_value(gpu->name, sizeof(gpu->name), "NVIDIA H100 80GB HBM3");
  gpu->memory_bytes = 81559ULL << 20;
  char line[256];
  while (fgets(line, sizeof(line), f) != NULL) {
    char *eq = strchr(line, '=');
    if (eq == NULL) continue;
    *eq = '\0';
    const char *key = line, *value = eq + 1;
    if (strcmp(key, "uuid") == 0) copy_value(gpu->uuid, sizeof(gpu->uuid), value);
    else if (strcmp(key, "name") == 0) copy_value(gpu->name, sizeof(gpu->name), value);
    else if (strcmp(key, "memory_mib") == 0) gpu->memory_bytes = strtoull(value, NULL, 10) << 20;
    else if (strcmp(key, "minor") == 0) gpu->minor = (unsigned int)strtoul(value, NULL, 10);
    else if (strcmp(key, "bus") == 0) gpu->bus = (unsigned int)strtoul(value, NULL, 10);
  }
  fclose(f);
  return gpu->uuid[0] != '\0';
}

static nvmlReturn_t load(void) {
  const char *root = getenv("VRAMSHARE_MOCK_NVML_ROOT");
  if (root == NULL || root[0] == '\0') root = "/run/vramshare-mock-nvml";
  DIR *dir = opendir(root);
  gpu_count = 0;
  // No directory is a machine without the driver loaded: NVML answers that, not "no GPUs".
  if (dir == NULL) return NVML_ERROR_DRIVER_NOT_LOADED;
  struct dirent *entry;
  while ((entry = readdir(dir)) != NULL && gpu_count < MAX_GPUS) {
    char *end;
    unsigned long index = strtoul(entry->d_name, &end, 10);
    if (entry->d_name[0] == '\0' || *end != '\0') continue;  // ".", "..", anything not an index
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", root, entry->d_name);
    if (read_gpu(path, (unsigned int)index, &gpus[gpu_count])) gpu_count++;
  }
  closedir(dir);
  qsort(gpus, gpu_count, sizeof(gpus[0]), by_index);
  return NVML_SUCCESS;
}

static nvmlReturn_t valid(nvmlDevice_t device) {
  if (!initialised) return NVML_ERROR_UNINITIALIZED;
  if (device.handle == NULL || device.handle < gpus || device.handle >= gpus + gpu_count) return NVML_ERROR_INVALID_ARGUMENT;
  return NVML_SUCCESS;
}

static nvmlReturn_t copy_string(char *dst, unsigned int length, const char *src) {
  if (dst == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
  memcpy(dst, src, strlen(src) + 1);
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
  (void)flags;
  nvmlReturn_t ret = load();
  if (ret == NVML_SUCCESS) initialised++;
  return ret;
}
EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

EXPORT nvmlReturn_t nvmlShutdown(void) {
  if (!initialised) return NVML_ERROR_UNINITIALIZED;
  initialised--;
  return NVML_SUCCESS;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
  switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    default: return "Unknown Error";
  }
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
  return copy_string(version, length, "580.95.05");
}
EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
  return copy_string(version, length, "13.580.95.05");
}
EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
  if (version == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  *version = 13000;
  return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) { return nvmlSystemGetCudaDriverVersion(version); }

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
  if (!initialised) return NVML_ERROR_UNINITIALIZED;
  if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  *count = gpu_count;
  return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
  if (!initialised) return NVML_ERROR_UNINITIALIZED;
  if (device == NULL || index >= gpu_count) return NVML_ERROR_INVALID_ARGUMENT;
  device->handle = &gpus[index];
  return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
  return nvmlDeviceGetHandleByIndex_v2(index, device);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
  if (!initialised) return NVML_ERROR_UNINITIALIZED;
  if (uuid == NULL || device == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  for (unsigned int i = 0; i < gpu_count; i++) {
    if (strcmp(gpus[i].uuid, uuid) == 0) {
      device->handle = &gpus[i];
      return NVML_SUCCESS;
    }
  }
  return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
  nvmlReturn_t ret = valid(device);
  return ret != NVML_SUCCESS ? ret : copy_string(uuid, length, device.handle->uuid);
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
  nvmlReturn_t ret = valid(device);
  return ret != NVML_SUCCESS ? ret : copy_string(name, length, device.handle->name);
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
  nvmlReturn_t ret = valid(device);
  if (ret != NVML_SUCCESS) return ret;
  *index = (unsigned int)(device.handle - gpus);
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
  nvmlReturn_t ret = valid(device);
  if (ret != NVML_SUCCESS) return ret;
  *minor = device.handle->minor;
  return NVML_SUCCESS;
}

// Memory as an idle GPU reports it: what processes allocate is DCGM's to tell (the fake exporter).
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
  nvmlReturn_t ret = valid(device);
  if (ret != NVML_SUCCESS) return ret;
  memory->total = device.handle->memory_bytes;
  memory->used = 512ULL << 20;
  memory->free = memory->total - memory->used;
  return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
  nvmlReturn_t ret = valid(device);
  if (ret != NVML_SUCCESS) return ret;
  memory->total = device.handle->memory_bytes;
  memory->reserved = 512ULL << 20;
  memory->used = 0;
  memory->free = memory->total - memory->reserved;
  return NVML_SUCCESS;
}

static nvmlReturn_t pci_info(nvmlDevice_t device, nvmlPciInfo_t *pci) {
  nvmlReturn_t ret = valid(device);
  if (ret != NVML_SUCCESS) return ret;
  memset(pci, 0, sizeof(*pci));
  pci->bus = device.handle->bus;
  pci->pciDeviceId = 0x233010DE;  // H100 SXM5, NVIDIA's vendor id
  snprintf(pci->busId, sizeof(pci->busId), NVML_DEVICE_PCI_BUS_ID_FMT, 0u, device.handle->bus, 0u);
  snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT, 0u, device.handle->bus, 0u);
  return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) { return pci_info(device, pci); }
EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) { return pci_info(device, pci); }
EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci) { return pci_info(device, pci); }

EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
  nvmlReturn_t ret = valid(device);
  if (ret != NVML_SUCCESS) return ret;
  *major = 9;
  *minor = 0;
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, nvmlDeviceArchitecture_t *arch) {
  nvmlReturn_t ret = valid(device);
  if (ret != NVML_SUCCESS) return ret;
  *arch = NVML_DEVICE_ARCH_HOPPER;
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, nvmlBrandType_t *brand) {
  nvmlReturn_t ret = valid(device);
  if (ret != NVML_SUCCESS) return ret;
  *brand = NVML_BRAND_NVIDIA;
  return NVML_SUCCESS;
}

// No MIG: these GPUs are whole (the mode query answers as a GPU without MIG support does).
EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
  nvmlReturn_t ret = valid(device);
  (void)current;
  (void)pending;
  return ret != NVML_SUCCESS ? ret : NVML_ERROR_NOT_SUPPORTED;
}
EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMig) {
  nvmlReturn_t ret = valid(device);
  if (ret != NVML_SUCCESS) return ret;
  *isMig = 0;
  return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
  nvmlReturn_t ret = valid(device);
  if (ret != NVML_SUCCESS) return ret;
  *count = 0;
  return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node) {
  (void)node;
  nvmlReturn_t ret = valid(device);
  return ret != NVML_SUCCESS ? ret : NVML_ERROR_NOT_SUPPORTED;
}

EXPORT nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t a, nvmlDevice_t b,
                                                        nvmlGpuTopologyLevel_t *level) {
  if (valid(a) != NVML_SUCCESS || valid(b) != NVML_SUCCESS || level == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  *level = NVML_TOPOLOGY_SYSTEM;
  return NVML_SUCCESS;
}

// Health: the device plugin registers for critical Xid events and waits on them. None ever comes: the
// wait sleeps out its timeout, as an event set on a healthy GPU does.
EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *types) {
  nvmlReturn_t ret = valid(device);
  if (ret != NVML_SUCCESS) return ret;
  *types = nvmlEventTypeXidCriticalError | nvmlEventTypeDoubleBitEccError | nvmlEventTypeSingleBitEccError;
  return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
  if (!initialised) return NVML_ERROR_UNINITIALIZED;
  set->handle = &event_set;
  return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types, nvmlEventSet_t set) {
  (void)types;
  (void)set;
  return valid(device);
}
EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
  (void)set;
  (void)data;
  struct timespec pause = {.tv_sec = timeoutms / 1000, .tv_nsec = (long)(timeoutms % 1000) * 1000000L};
  nanosleep(&pause, NULL);
  return NVML_ERROR_TIMEOUT;
}
EXPORT nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
  return nvmlEventSetWait_v2(set, data, timeoutms);
}
EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
  (void)set;
  return NVML_SUCCESS;
}

// No NVLink (GPUs on PCIe): the device plugin's preferred allocation asks each link's state.
EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *active) {
  (void)link;
  (void)active;
  nvmlReturn_t ret = valid(device);
  return ret != NVML_SUCCESS ? ret : NVML_ERROR_NOT_SUPPORTED;
}
EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci) {
  (void)link;
  (void)pci;
  nvmlReturn_t ret = valid(device);
  return ret != NVML_SUCCESS ? ret : NVML_ERROR_NOT_SUPPORTED;
}
EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci) {
  return nvmlDeviceGetNvLinkRemotePciInfo_v2(device, link, pci);
}
EXPORT nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t a, nvmlDevice_t b, nvmlGpuP2PCapsIndex_t index,
                                          nvmlGpuP2PStatus_t *status) {
  (void)index;
  if (valid(a) != NVML_SUCCESS || valid(b) != NVML_SUCCESS || status == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  *status = NVML_P2P_STATUS_NOT_SUPPORTED;
  return NVML_SUCCESS;
}
