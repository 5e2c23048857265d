#include "packer.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <string>

#include "../core/profiler.h"
#include "device_memory.h"
#include "runtime.h"
#include "tensor_layout.h"

namespace py = pybind11;

namespace ckpt_offload {

namespace {

bool is_parameter_object(PyObject* obj) { return PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(ParameterClass)); }

}  // namespace

Packer::Packer(PackerOptions options) : options_(std::move(options)), counters_(std::make_shared<PackerCounters>()) {
  if (!options_.pool) throw std::invalid_argument("ckpt_offload: Packer needs a pool");
  // Prefetching on the compute stream would only move the same stall earlier.
  if (options_.prefetch_bytes > 0 && options_.side_stream)
    prefetcher_ = std::make_shared<Prefetcher>(options_.prefetch_bytes, counters_, options_.prefetch_auto);
}

void Packer::flush_batches() {
  std::map<int, std::shared_ptr<Batch>> open;
  {
    std::lock_guard<std::mutex> lock(mu_);
    open.swap(open_batches_);
  }
  size_t refused = 0, refused_bytes = 0;
  TieredRefusal why = TieredRefusal::PoolFull;
  for (auto& kv : open) {
    if (!kv.second->flush()) {
      refused += kv.second->size();
      refused_bytes += kv.second->block_bytes();
      why = kv.second->refusal();
    }
  }
  if (refused && options_.raise_on_full)
    throw PoolFull(full_message(why, *options_.pool, "a batch of " + std::to_string(refused) + " small saved tensors",
                                static_cast<int64_t>(refused_bytes)) +
                   " (The batch's tensors were kept on the device, so backward still works.)");
}

void Packer::begin() {
  if (prefetcher_) prefetcher_->mark_block();  // each activation is a block (Note [Prefetch window])
  std::lock_guard<std::mutex> lock(mu_);
  parameter_storages_.clear();
  buffer_storages_.clear();
}

void Packer::end(bool keep_dedup) {
  flush_batches();
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
  if (why != KeepReason::Parameter && why != KeepReason::Buffer) {
    saved->device_held_.set(nbytes);
  }
  if (profiler::enabled()) {
    profiler::KeepRecord k;
    k.reason = keep_reason_name(why);
    k.dtype = dtype_name(t.scalar_type());
    k.module = profiler::scope();
    k.bytes = static_cast<size_t>(nbytes);
    k.device = device_index(t.device());
    k.shape = t.sizes().vec();
    profiler::add(std::move(k));
    sample_memory(options_.pool.get(), t.device());
  }
  return py::cast(std::move(saved));
}

std::optional<KeepReason> Packer::classify(PyObject* o, const at::Tensor& t, Span* span, int64_t* keep_bytes) {
  const int64_t itemsize = static_cast<int64_t>(t.dtype().itemsize());
  *keep_bytes = t.numel() * itemsize;
  if (is_parameter_object(o)) return KeepReason::Parameter;
  if (!THPVariable_CheckExact(o) || wrapped_tensor(t)) return KeepReason::Subclass;
  if (unsupported_layout(t)) return KeepReason::Layout;
  const c10::Device device = t.device();
  const bool device_ok = (device.is_cpu() && options_.offload_cpu) || (device.is_cuda() && options_.offload_cuda);
  if (!device_ok) return KeepReason::Device;
  // Under CUDA graph capture events cannot be queried and the pool's addresses would be baked
  // into the graph: leave such tensors alone.
  if (current_stream_capturing(device)) return KeepReason::GraphCapture;

  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (parameter_storages_.count(storage)) return KeepReason::Parameter;
    if (buffer_storages_.count(storage)) return KeepReason::Buffer;
  }
  if (t.is_view()) {
    // nn.Linear saves weight.t(): a plain Tensor whose base is the Parameter.
    const at::TensorBase& base = t._base();
    PyObject* base_obj = THPVariable_Wrap(base);
    const bool param_base = base_obj && is_parameter_object(base_obj);
    Py_XDECREF(base_obj);
    if (param_base) return KeepReason::Parameter;
  }

  const int64_t extent = extent_elements(t);
  if (extent == 0) {
    *keep_bytes = 0;
    return KeepReason::TooSmall;
  }
  span->itemsize = itemsize;
  span->lo = t.storage_offset() * itemsize;
  span->hi = span->lo + extent * itemsize;
  if (span->bytes() < options_.min_bytes) {
    *keep_bytes = span->bytes();
    return KeepReason::TooSmall;
  }
  const auto& vc = t.unsafeGetTensorImpl()->version_counter();
  span->version = vc.enabled() ? vc.current_version() : 0;
  return std::nullopt;
}

std::shared_ptr<SavedTensor> Packer::find_duplicate(const at::Tensor& t, const Span& span) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = dedup_.find(storage);
  if (it == dedup_.end()) return nullptr;
  DedupEntry& e = it->second;
  auto alive = e.storage.lock();
  auto held = e.offloaded.lock();
  if (alive.get() != storage || !held || e.version != span.version || span.lo < e.lo || span.hi > e.hi ||
      (span.lo - e.lo) % span.itemsize != 0)
    return nullptr;
  auto saved = SavedTensor::describe_layout(t, counters_);
  saved->side_stream_ = options_.side_stream;
  saved->storage_ = std::move(held);
  saved->storage_->link();
  saved->offset_ = static_cast<int64_t>(saved->storage_->pad() + (span.lo - e.lo)) / span.itemsize;
  counters_->tensors_deduplicated++;
  counters_->bytes_deduplicated += span.bytes();
  return saved;
}

std::shared_ptr<SavedTensor> Packer::pack_batched(const at::Tensor& t, const Span& span) {
  auto saved = SavedTensor::describe_layout(t, counters_);
  saved->side_stream_ = options_.side_stream;
  const c10::Device device = t.device();
  const int key = device_index(device);
  for (;;) {
    std::shared_ptr<Batch> batch, full;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& open = open_batches_[key];
      if (open && (open->flushed() || open->block_bytes() + static_cast<size_t>(span.bytes()) + 16 >
                                          static_cast<size_t>(options_.batch_bytes))) {
        full = std::move(open);
        open.reset();
      }
      if (!open) open = std::make_shared<Batch>(device, options_.side_stream, options_.pool, counters_, prefetcher_);
      batch = open;
    }
    if (full && !full->flush() && options_.raise_on_full)
      throw PoolFull(full_message(full->refusal(), *options_.pool, "a batch of " + std::to_string(full->size()) +
                                  " small saved tensors", static_cast<int64_t>(full->block_bytes())) +
                     " (The batch's tensors were kept on the device, so backward still works.)");
    // Null when an unpack flushed the batch meanwhile: take a new one.
    saved->storage_ = batch->add(t, span.lo, span.bytes());
    if (saved->storage_) {
      saved->storage_->link();
      break;
    }
  }
  saved->offset_ = static_cast<int64_t>(saved->storage_->pad()) / span.itemsize;
  counters_->tensors_batched++;
  return saved;
}

std::shared_ptr<SavedTensor> Packer::pack_single(const at::Tensor& t, TieredRefusal* why) {
  auto saved = SavedTensor::offload(t, options_.pool, options_.side_stream, counters_, why);
  if (saved && prefetcher_) saved->storage_->set_order(prefetcher_, prefetcher_->add(saved->storage_));
  return saved;
}

void Packer::remember(const at::Tensor& t, const Span& span, const std::shared_ptr<SavedTensor>& saved) {
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
  DedupEntry& e = dedup_[t.storage().unsafeGetStorageImpl()];
  e.storage = t.storage().getWeakStorageImpl();
  e.offloaded = saved->storage_;
  e.version = span.version;
  e.lo = span.lo;
  e.hi = span.hi;
}

py::object Packer::pack(py::handle obj) {
  PyObject* o = obj.ptr();
  if (!THPVariable_Check(o)) return py::reinterpret_borrow<py::object>(obj);
  const at::Tensor& t = THPVariable_Unpack(o);
  Span span;
  int64_t keep_bytes = 0;
  if (auto why = classify(o, t, &span, &keep_bytes)) return keep(t, *why, keep_bytes);
  if (auto dup = find_duplicate(t, span)) return py::cast(std::move(dup));

  std::shared_ptr<SavedTensor> saved;
  if (options_.batch_below > 0 && span.bytes() < options_.batch_below) {
    saved = pack_batched(t, span);
  } else {
    TieredRefusal why = TieredRefusal::None;
    saved = pack_single(t, &why);
    if (!saved) {
      if (options_.raise_on_full) throw PoolFull(full_message(why, *options_.pool, t, span.bytes()));
      return keep(t, why == TieredRefusal::DiskFull ? KeepReason::DiskFull : KeepReason::PoolFull, span.bytes());
    }
  }
  counters_->tensors_offloaded++;
  counters_->bytes_offloaded += span.bytes();
  remember(t, span, saved);
  sample_memory(options_.pool.get(), t.device());
  return py::cast(std::move(saved));
}

at::Tensor Packer::unpack(py::handle obj) {
  if (!py::isinstance<SavedTensor>(obj)) {
    if (THPVariable_Check(obj.ptr())) return THPVariable_Unpack(obj.ptr());
    throw py::type_error("ckpt_offload: unpack got an object that ckpt_offload did not pack");
  }
  const int task = torch::autograd::get_current_graph_task_id();
  if (task >= 0 && last_graph_task_.exchange(task) != task) {
    // Once per backward: what this backward leaves behind is released when it ends, not when
    // its graph dies or the next forward offloads.
    torch::autograd::Engine::get_default_engine().queue_callback(
        [prefetcher = prefetcher_, pool = options_.pool] { end_of_backward(prefetcher, pool); });
  }
  return obj.cast<SavedTensor&>().unpack();
}

void Packer::end_of_backward(const std::shared_ptr<Prefetcher>& prefetcher, const std::shared_ptr<HostPool>& pool) {
  if (prefetcher) prefetcher->drop_unused();
  engine().poll();
  if (pool) pool->release_retired();
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
    {  // every reason, zeros included: callers index it without .get()
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
  d["tensors_batched"] = c.tensors_batched.load();
  d["batches"] = c.batches.load();
  d["prefetches"] = c.prefetches.load();
  d["bytes_prefetched"] = c.bytes_prefetched.load();
  d["prefetch_hits"] = c.prefetch_hits.load();
  d["prefetches_unused"] = c.prefetches_unused.load();
  d["peak_prefetch_bytes"] = c.peak_prefetch_bytes.load();
  d["prefetch_failures"] = c.prefetch_failures.load();
  // The window backward used last (Note [Prefetch window]); 0 without prefetch.
  d["prefetch_window_bytes"] = prefetcher_ ? (prefetcher_->auto_window() ? prefetcher_->window() : options_.prefetch_bytes) : 0;
  d["prefetch_block_bytes"] = prefetcher_ ? prefetcher_->block_bytes() : 0;
  d["prefetch_lead"] = prefetcher_ ? prefetcher_->lead() : 0;
  d["tensors_spilled"] = c.tensors_spilled.load();
  d["bytes_spilled"] = c.bytes_spilled.load();
  d["disk_prefetches"] = c.disk_prefetches.load();
  return d;
}

}  // namespace ckpt_offload
