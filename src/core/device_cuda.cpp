#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/device.h"

namespace moecore {

bool cuda_built() { return true; }

DeviceInfo cuda_device_info() {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    return DeviceInfo{false, 0, std::string("CUDA unavailable: ") + cudaGetErrorString(err)};
  }
  DeviceInfo info{n > 0, n, ""};
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) == cudaSuccess) {
      info.description += (i ? ", " : "") + std::string(prop.name);
    }
  }
  if (n == 0) info.description = "CUDA built in, but no device is visible";
  return info;
}

namespace {
// nvidia-smi's spelling of a UUID: "GPU-" then 8-4-4-4-12 hex digits.
std::string format_uuid(const cudaUUID_t& uuid) {
  std::string out = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    char hex[3];
    std::snprintf(hex, sizeof hex, "%02x", static_cast<unsigned char>(uuid.bytes[i]));
    out += hex;
  }
  return out;
}
}  // namespace

std::vector<CudaDeviceId> cuda_visible_devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return {};
  std::vector<CudaDeviceId> out;
  for (int i = 0; i < n; ++i) {
    // Properties come from the driver: no context is created on device i.
    cudaDeviceProp prop{};
    const cudaError_t err = cudaGetDeviceProperties(&prop, i);
    MOE_CHECK(err == cudaSuccess, "[device] the properties of CUDA device {}: {}", i,
              cudaGetErrorString(err));
    char bus[32];
    std::snprintf(bus, sizeof bus, "%04x:%02x:%02x.0", prop.pciDomainID, prop.pciBusID,
                  prop.pciDeviceID);
    out.push_back(CudaDeviceId{prop.name, format_uuid(prop.uuid), bus});
  }
  return out;
}

void cuda_select_device(int ordinal) {
  const cudaError_t err = cudaSetDevice(ordinal);
  MOE_CHECK(err == cudaSuccess, "[device] cudaSetDevice({}): {}", ordinal, cudaGetErrorString(err));
}

int cuda_current_device() {
  int d = 0;
  const cudaError_t err = cudaGetDevice(&d);
  MOE_CHECK(err == cudaSuccess, "[device] cudaGetDevice: {}", cudaGetErrorString(err));
  return d;
}

Exec make_cuda_exec() {
  const DeviceInfo info = cuda_device_info();
  MOE_CHECK(info.available, "[exec] --device cuda: {}; use --device cpu", info.description);
  cudaStream_t stream = nullptr;
  const cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  MOE_CHECK(err == cudaSuccess, "[exec] --device cuda: cudaStreamCreate failed: {}",
            cudaGetErrorString(err));
  Exec ex;
  ex.device = Device::CUDA;
  ex.stream = stream;
  return ex;
}

void* cuda_alloc(const Exec& ex, MemSpace space, size_t bytes) {
  void* p = nullptr;
  const cudaError_t err =
      space == MemSpace::Device ? cudaMalloc(&p, bytes) : cudaMallocHost(&p, bytes);
  MOE_CHECK(err == cudaSuccess, "[exec] cannot allocate {} bytes of {} memory: {}", bytes,
            mem_space_name(space), cudaGetErrorString(err));
  if (space == MemSpace::PinnedHost) {
    std::memset(p, 0, bytes);
    return p;
  }
  // Planning happens before step 0: the block is zero before anything reads it.
  cudaStream_t stream = static_cast<cudaStream_t>(ex.stream);
  cudaError_t set = cudaMemsetAsync(p, 0, bytes, stream);
  if (set == cudaSuccess) set = cudaStreamSynchronize(stream);
  MOE_CHECK(set == cudaSuccess, "[exec] cannot zero {} bytes of device memory: {}", bytes,
            cudaGetErrorString(set));
  return p;
}

bool cuda_stream_idle(const Exec& ex) {
  const cudaError_t err = cudaStreamQuery(static_cast<cudaStream_t>(ex.stream));
  if (err == cudaErrorNotReady) return false;
  MOE_CHECK(err == cudaSuccess, "[exec] the step's stream failed: {}", cudaGetErrorString(err));
  return true;
}

namespace {
class CudaPhaseTimer : public PhaseTimer {
 public:
  CudaPhaseTimer(cudaStream_t stream, int capacity) : stream_(stream), events_(capacity) {
    for (cudaEvent_t& e : events_) {
      const cudaError_t err = cudaEventCreate(&e);
      MOE_CHECK(err == cudaSuccess, "[profiler] cudaEventCreate: {}", cudaGetErrorString(err));
    }
  }
  ~CudaPhaseTimer() override {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  int capacity() const override { return static_cast<int>(events_.size()); }
  void mark(int i) override { cudaEventRecord(events_[i], stream_); }
  void move(int i, int j) override { std::swap(events_[i], events_[j]); }
  double seconds(int i, int j) override {
    cudaEventSynchronize(events_[j]);
    float ms = 0;
    const cudaError_t err = cudaEventElapsedTime(&ms, events_[i], events_[j]);
    MOE_CHECK(err == cudaSuccess, "[profiler] cudaEventElapsedTime: {}", cudaGetErrorString(err));
    return ms * 1e-3;
  }

 private:
  cudaStream_t stream_;
  std::vector<cudaEvent_t> events_;
};
}  // namespace

std::unique_ptr<PhaseTimer> make_cuda_phase_timer(const Exec& ex, int capacity) {
  return std::make_unique<CudaPhaseTimer>(static_cast<cudaStream_t>(ex.stream), capacity);
}

void cuda_free(const Exec&, MemSpace space, void* p) {
  if (space == MemSpace::Device) {
    cudaFree(p);
  } else {
    cudaFreeHost(p);
  }
}

// ---- CUDA graphs of the context's stream (core/stream_graph.h) ----

void cuda_capture_begin(const Exec& ex) {
  // Global mode: an unsafe call (cudaMalloc, a synchronisation) from any thread while the stream
  // captures fails the capture, as the emulated device's rules do.
  const cudaError_t err =
      cudaStreamBeginCapture(static_cast<cudaStream_t>(ex.stream), cudaStreamCaptureModeGlobal);
  MOE_CHECK(err == cudaSuccess, "[cuda-graph] cudaStreamBeginCapture: {}", cudaGetErrorString(err));
}

void* cuda_capture_end(const Exec& ex, bool keep, int64_t* operations) {
  cudaGraph_t graph = nullptr;
  const cudaError_t err = cudaStreamEndCapture(static_cast<cudaStream_t>(ex.stream), &graph);
  if (!keep) {  // the capture failed: the stream leaves capture mode, the graph goes
    if (graph != nullptr) cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    return nullptr;
  }
  MOE_CHECK(err == cudaSuccess,
            "[cuda-graph] cudaStreamEndCapture: {} (an operation of the captured region was not "
            "capturable, or another thread made an unsafe CUDA call during the capture)",
            cudaGetErrorString(err));
  size_t nodes = 0;
  cudaError_t step = cudaGraphGetNodes(graph, nullptr, &nodes);
  cudaGraphExec_t exec = nullptr;
  if (step == cudaSuccess) step = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  MOE_CHECK(step == cudaSuccess, "[cuda-graph] cudaGraphInstantiate of {} nodes: {}", nodes,
            cudaGetErrorString(step));
  if (operations != nullptr) *operations = static_cast<int64_t>(nodes);
  return exec;
}

void cuda_graph_launch(const Exec& ex, void* graph) {
  const cudaError_t err =
      cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), static_cast<cudaStream_t>(ex.stream));
  MOE_CHECK(err == cudaSuccess, "[cuda-graph] cudaGraphLaunch: {}", cudaGetErrorString(err));
}

void cuda_graph_destroy(void* graph) {
  if (graph != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph));
}

}  // namespace moecore
