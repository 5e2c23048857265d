#include "saved_tensor.h"

#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <sstream>

#include "runtime.h"

#ifdef CKPT_OFFLOAD_WITH_CUDA
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

namespace py = pybind11;

namespace ckpt_offload {

const char* keep_reason_name(KeepReason r) {
  switch (r) {
    case KeepReason::Parameter: return "parameter";
    case KeepReason::Buffer: return "buffer";
    case KeepReason::TooSmall: return "too_small";
    case KeepReason::Device: return "device";
    case KeepReason::Layout: return "layout";
    case KeepReason::Subclass: return "subclass";
    case KeepReason::PoolFull: return "pool_full";
    case KeepReason::GraphCapture: return "cuda_graph_capture";
    default: return "unknown";
  }
}

namespace {

std::string describe(c10::ScalarType dtype, const std::vector<int64_t>& sizes, const c10::Device& device) {
  std::ostringstream s;
  s << "[" << c10::toString(dtype) << " on " << device << ", shape [";
  for (size_t i = 0; i < sizes.size(); ++i) s << (i ? ", " : "") << sizes[i];
  s << "]]";
  return s.str();
}

std::string human_bytes(size_t bytes) {
  static const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  std::ostringstream s;
  if (u == 0) {
    s << bytes << " bytes";
  } else {
    s.precision(1);
    s << std::fixed << v << " " << units[u];
  }
  return s.str();
}

// Layouts whose bytes are not plain strided memory, or whose flags a raw copy would drop.
bool unsupported_layout(const at::Tensor& t) {
  return t.layout() != c10::kStrided || t.is_nested() || t.is_quantized() || t.is_mkldnn() || t.is_meta() ||
         t.is_conj() || t.is_neg() || !t.has_storage();
}

// Wrapper tensors (functorch, functionalization, __torch_dispatch__ subclasses) have a
// storage that is not theirs to copy.
bool wrapped_tensor(const at::Tensor& t) {
  static const c10::DispatchKeySet wrappers({c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper,
                                             c10::DispatchKey::Functionalize, c10::DispatchKey::Python,
                                             c10::DispatchKey::BatchedNestedTensor});
  return t.key_set().has_any(wrappers);
}

// Elements of its storage a tensor reaches, from its first one. An expanded tensor (stride 0)
// reaches only its source's elements, so it does not grow on the host.
int64_t extent_elements(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t extent = 1;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  return extent;
}

bool is_parameter_object(PyObject* obj) { return PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(ParameterClass)); }

}  // namespace

c10::Storage OffloadedStorage::materialize(bool side_stream, bool* shared) {
  std::lock_guard<std::mutex> lock(mu_);
  StreamPair streams(device_, side_stream, /*to_host=*/false);
  if (auto alive = reloaded_.lock()) {
    // Another view (or an earlier unpack) already brought these bytes back. The copy may
    // have been ordered on another stream: order this one after it too.
    streams.compute().wait(reloaded_ready_);
    *shared = true;
    return c10::Storage(std::move(alive));
  }
  *shared = false;
  // Allocated on the compute stream, which consumes it: no cross-stream reuse hazard.
  at::Tensor bytes = at::empty({static_cast<int64_t>(pad_ + buffer_->nbytes())},
                               at::TensorOptions().dtype(at::kByte).device(device_));
  c10::Storage storage = bytes.storage();
  char* dst = static_cast<char*>(storage.mutable_data()) + pad_;
  reloaded_ready_ = engine().reload(*buffer_, dst, streams.compute(), streams.copy());
  reloaded_ = storage.getWeakStorageImpl();
  return storage;
}

void SavedTensor::check_version() const {
  if (!version_.enabled()) return;
  const uint32_t now = version_.current_version();
  if (now == saved_version_) return;
  std::ostringstream msg;
  msg << "one of the variables needed for gradient computation has been modified by an inplace operation: "
      << describe(dtype_, sizes_, device_) << " is at version " << now << "; expected version " << saved_version_
      << " instead. (Detected by ckpt_offload: the tensor was modified in place after autograd saved it, so "
      << "backward would have used the wrong values.) Hint: clone the tensor before modifying it in place, or "
      << "use the out-of-place operation.";
  throw std::runtime_error(msg.str());
}

at::Tensor SavedTensor::unpack() {
  check_version();
  if (!storage_) return kept_;
  bool shared = false;
  c10::Storage st = storage_->materialize(side_stream_, &shared);
  if (shared) {
    counters_->tensors_reload_shared++;
  } else {
    counters_->tensors_reloaded++;
    counters_->bytes_reloaded += static_cast<int64_t>(storage_->nbytes());
  }
  at::Tensor out = at::empty({0}, at::TensorOptions().dtype(dtype_).device(st.device()));
  out.set_(st, offset_, sizes_, strides_);
  return out;
}

Packer::Packer(PackerOptions options) : options_(std::move(options)), counters_(std::make_shared<PackerCounters>()) {
  if (!options_.pool) throw std::invalid_argument("ckpt_offload: Packer needs a pool");
}

void Packer::begin() {
  std::lock_guard<std::mutex> lock(mu_);
  parameter_storages_.clear();
  buffer_storages_.clear();
}

void Packer::end(bool keep_dedup) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!keep_dedup) dedup_.clear();
    parameter_storages_.clear();
    buffer_storages_.clear();
  }
  engine().poll();
}

void Packer::note_module_state(py::handle parameters, py::handle buffers) {
  std::lock_guard<std::mutex> lock(mu_);
  auto add = [](py::handle dict, std::unordered_set<const void*>& into) {
    if (!dict || dict.is_none()) return;
    for (auto item : py::reinterpret_borrow<py::dict>(dict)) {
      PyObject* v = item.second.ptr();
      if (v == Py_None || !THPVariable_Check(v)) continue;
      const at::Tensor& t = THPVariable_Unpack(v);
      if (t.has_storage()) into.insert(t.storage().unsafeGetStorageImpl());
    }
  };
  add(parameters, parameter_storages_);
  add(buffers, buffer_storages_);
}

py::object Packer::keep(const at::Tensor& t, KeepReason why, int64_t nbytes) {
  counters_->kept_tensors[static_cast<int>(why)]++;
  counters_->kept_bytes[static_cast<int>(why)] += nbytes;
  auto saved = SavedTensor::describe_layout(t, counters_);
  // A detached alias: same storage and version counter, but no grad_fn, so an output saved
  // by its own node does not form a reference cycle that would leak the graph.
  saved->kept_ = t.detach();
  saved->nbytes_ = nbytes;
  return py::cast(std::move(saved));
}

py::object Packer::pack(py::handle obj) {
  PyObject* o = obj.ptr();
  if (!THPVariable_Check(o)) return py::reinterpret_borrow<py::object>(obj);
  const at::Tensor& t = THPVariable_Unpack(o);
  const int64_t itemsize = static_cast<int64_t>(t.dtype().itemsize());
  const int64_t logical_bytes = t.numel() * itemsize;

  if (is_parameter_object(o)) return keep(t, KeepReason::Parameter, logical_bytes);
  if (!THPVariable_CheckExact(o) || wrapped_tensor(t)) return keep(t, KeepReason::Subclass, logical_bytes);
  if (unsupported_layout(t)) return keep(t, KeepReason::Layout, logical_bytes);
  const c10::Device device = t.device();
  const bool device_ok = (device.is_cpu() && options_.offload_cpu) || (device.is_cuda() && options_.offload_cuda);
  if (!device_ok) return keep(t, KeepReason::Device, logical_bytes);
#ifdef CKPT_OFFLOAD_WITH_CUDA
  // Under CUDA graph capture events cannot be queried and the pool's addresses would be baked
  // into the graph: leave such tensors alone.
  if (device.is_cuda() && c10::cuda::captureStatusMayInitCtx(c10::cuda::getCurrentCUDAStream(device.index()).stream()) !=
                               c10::cuda::CaptureStatus::None)
    return keep(t, KeepReason::GraphCapture, logical_bytes);
#endif

  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (parameter_storages_.count(storage)) return keep(t, KeepReason::Parameter, logical_bytes);
    if (buffer_storages_.count(storage)) return keep(t, KeepReason::Buffer, logical_bytes);
  }
  if (t.is_view()) {
    // nn.Linear saves weight.t(): a plain Tensor whose base is the Parameter.
    const at::TensorBase& base = t._base();
    PyObject* base_obj = THPVariable_Wrap(base);
    const bool param_base = base_obj && is_parameter_object(base_obj);
    Py_XDECREF(base_obj);
    if (param_base) return keep(t, KeepReason::Parameter, logical_bytes);
  }

  const int64_t extent = extent_elements(t);
  if (extent == 0) return keep(t, KeepReason::TooSmall, 0);
  const int64_t lo = t.storage_offset() * itemsize;
  const int64_t hi = lo + extent * itemsize;
  const int64_t span = hi - lo;
  if (span < options_.min_bytes) return keep(t, KeepReason::TooSmall, span);

  const auto& vc = t.unsafeGetTensorImpl()->version_counter();
  const uint32_t version = vc.enabled() ? vc.current_version() : 0;

  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = dedup_.find(storage);
    if (it != dedup_.end()) {
      DedupEntry& e = it->second;
      auto alive = e.storage.lock();
      auto held = e.offloaded.lock();
      if (alive.get() == storage && held && e.version == version && lo >= e.lo && hi <= e.hi &&
          (lo - e.lo) % itemsize == 0) {
        auto saved = SavedTensor::describe_layout(t, counters_);
        saved->side_stream_ = options_.side_stream;
        saved->storage_ = std::move(held);
        saved->offset_ = static_cast<int64_t>(saved->storage_->pad() + (lo - e.lo)) / itemsize;
        counters_->tensors_deduplicated++;
        counters_->bytes_deduplicated += span;
        return py::cast(std::move(saved));
      }
    }
  }

  auto saved = SavedTensor::offload(t, options_.pool, options_.side_stream, counters_);
  if (!saved) {
    if (options_.raise_on_full) throw PoolFull(pool_full_message(*options_.pool, t, span));
    return keep(t, KeepReason::PoolFull, span);
  }
  counters_->tensors_offloaded++;
  counters_->bytes_offloaded += span;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (dedup_.size() >= prune_at_) {
      for (auto it = dedup_.begin(); it != dedup_.end();) {
        if (it->second.offloaded.expired() || it->second.storage.expired())
          it = dedup_.erase(it);
        else
          ++it;
      }
      prune_at_ = std::max<size_t>(1024, 2 * dedup_.size());
    }
    DedupEntry& e = dedup_[storage];
    e.storage = t.storage().getWeakStorageImpl();
    e.offloaded = saved->storage_;
    e.version = version;
    e.lo = lo;
    e.hi = hi;
  }
  return py::cast(std::move(saved));
}

std::string pool_full_message(HostPool& pool, const at::Tensor& t, int64_t span) {
  PoolStats ps = pool.stats();
  std::ostringstream msg;
  msg << "ckpt_offload: the host pool is full. Asked for " << human_bytes(span) << " (" << span
      << " bytes) for a saved tensor " << describe(t.scalar_type(), t.sizes().vec(), t.device()) << "; "
      << human_bytes(ps.bytes_in_use) << " in use, " << human_bytes(ps.bytes_pending) << " waiting for copies, "
      << human_bytes(ps.bytes_reserved) << " reserved, cap "
      << (ps.max_bytes ? human_bytes(ps.max_bytes) : std::string("none (the backend refused the memory)")) << ". Raise the cap (co.HostPool(max_bytes=...) or "
      << "pool.set_max_bytes(...)), offload less (a larger min_bytes), or pass on_full=\"keep\" to keep such "
      << "tensors on the device.";
  return msg.str();
}

std::shared_ptr<SavedTensor> SavedTensor::describe_layout(const at::Tensor& t,
                                                          std::shared_ptr<PackerCounters> counters) {
  auto saved = std::make_shared<SavedTensor>();
  saved->dtype_ = t.scalar_type();
  saved->device_ = t.device();
  saved->sizes_ = t.sizes().vec();
  saved->strides_ = t.strides().vec();
  saved->counters_ = std::move(counters);
  const auto& vc = t.unsafeGetTensorImpl()->version_counter();
  if (vc.enabled()) {
    saved->version_ = vc;
    saved->saved_version_ = vc.current_version();
  }
  saved->nbytes_ = extent_elements(t) * static_cast<int64_t>(t.dtype().itemsize());
  return saved;
}

std::shared_ptr<SavedTensor> SavedTensor::offload(const at::Tensor& t, const std::shared_ptr<HostPool>& pool,
                                                  bool side_stream, std::shared_ptr<PackerCounters> counters) {
  auto saved = describe_layout(t, std::move(counters));
  saved->side_stream_ = side_stream;
  const int64_t lo = t.storage_offset() * static_cast<int64_t>(t.dtype().itemsize());
  StreamPair streams(t.device(), side_stream, /*to_host=*/true);
  // Hold the storage (not the tensor: no autograd metadata) until the copy has read it.
  auto keepalive = std::make_shared<c10::Storage>(t.storage());
  const char* src = static_cast<const char*>(t.storage().data()) + lo;
  auto buffer = engine().offload(pool, src, static_cast<size_t>(saved->nbytes_), streams.compute(), streams.copy(),
                                 std::move(keepalive));
  if (!buffer) return nullptr;
  const size_t pad = static_cast<size_t>(lo) % OffloadedStorage::kReloadAlignment;
  saved->storage_ = std::make_shared<OffloadedStorage>(std::move(buffer), t.device(), pad);
  saved->offset_ = static_cast<int64_t>(pad) / static_cast<int64_t>(t.dtype().itemsize());
  return saved;
}

std::shared_ptr<SavedTensor> offload_tensor(const at::Tensor& t, const std::shared_ptr<HostPool>& pool,
                                            bool side_stream) {
  if (!t.defined()) throw std::invalid_argument("ckpt_offload.offload_tensor: tensor is undefined");
  if (unsupported_layout(t) || wrapped_tensor(t))
    throw std::invalid_argument("ckpt_offload.offload_tensor: tensor must be a plain strided tensor, got layout " +
                                c10::str(t.layout()) + (t.is_conj() ? " with the conjugate bit set" : "") +
                                (t.is_neg() ? " with the negative bit set" : ""));
  if (!t.device().is_cpu() && !t.device().is_cuda())
    throw std::invalid_argument("ckpt_offload.offload_tensor: tensor must be on 'cpu' or 'cuda', got " +
                                t.device().str());
  if (t.device().is_cuda() && !cuda_compiled())
    throw std::invalid_argument("ckpt_offload.offload_tensor: this build has no CUDA");
  auto saved = SavedTensor::offload(t, pool, side_stream, std::make_shared<PackerCounters>());
  if (!saved) throw PoolFull(pool_full_message(*pool, t, SavedTensor::describe_layout(t, nullptr)->nbytes()));
  return saved;
}

at::Tensor Packer::unpack(py::handle obj) {
  if (!py::isinstance<SavedTensor>(obj)) {
    if (THPVariable_Check(obj.ptr())) return THPVariable_Unpack(obj.ptr());
    throw py::type_error("ckpt_offload: unpack got an object that ckpt_offload did not pack");
  }
  return obj.cast<SavedTensor&>().unpack();
}

py::dict Packer::stats() const {
  const PackerCounters& c = *counters_;
  py::dict kept_by_reason, kept_bytes_by_reason;
  int64_t kept = 0, kept_bytes = 0;
  for (int r = 0; r < static_cast<int>(KeepReason::kCount); ++r) {
    const int64_t n = c.kept_tensors[r].load();
    const int64_t b = c.kept_bytes[r].load();
    kept += n;
    kept_bytes += b;
    if (n) {
      kept_by_reason[keep_reason_name(static_cast<KeepReason>(r))] = n;
      kept_bytes_by_reason[keep_reason_name(static_cast<KeepReason>(r))] = b;
    }
  }
  py::dict d;
  d["tensors_offloaded"] = c.tensors_offloaded.load();
  d["bytes_offloaded"] = c.bytes_offloaded.load();
  d["tensors_deduplicated"] = c.tensors_deduplicated.load();
  d["bytes_deduplicated"] = c.bytes_deduplicated.load();
  d["tensors_kept"] = kept;
  d["bytes_kept"] = kept_bytes;
  d["kept_by_reason"] = kept_by_reason;
  d["kept_bytes_by_reason"] = kept_bytes_by_reason;
  d["tensors_reloaded"] = c.tensors_reloaded.load();
  d["bytes_reloaded"] = c.bytes_reloaded.load();
  d["tensors_reload_shared"] = c.tensors_reload_shared.load();
  return d;
}

}  // namespace ckpt_offload
