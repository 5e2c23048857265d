// The saved-tensor hooks' per-tensor work (packer.h): pack decides and places, unpack brings
// back; begin and end bound an activation; stats reads the counters.
#include "packer.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <exception>
#include <string>
#include <tuple>

#include "../core/profiler.h"
#include "autograd_objects.h"
#include "device_memory.h"
#include "host_copies.h"
#include "runtime.h"
#include "tensor_layout.h"
#include "torch_internals.h"

namespace py = pybind11;

namespace ckpt_offload {

namespace {

// PoolFull for a batch of `tensors` small saved tensors (`bytes` in all) that the pool refused
// at its flush (on_full="raise").
PoolFull batch_refused(TieredRefusal why, HostPool& pool, size_t tensors, size_t bytes) {
  const PoolFull full = pool_full(why, pool, "a batch of " + std::to_string(tensors) + " small saved tensors",
                                  static_cast<int64_t>(bytes));
  return PoolFull(full.facts(),
                  full.remedies() + " (The batch's tensors were kept on the device, so backward still works.)");
}

}  // namespace

// Note [Selective checkpoint cache mutation]
// torch's selective activation checkpoint (SAC) with respect_saved_tensors_hooks=True hands the
// tensors it caches to our pack hook, and in backward calls our unpack from
// _VersionWrapper.get_val(allow_cache_entry_mutation). With allow_cache_entry_mutation=True
// torch lets a cached tensor be modified in place after it was cached (its own check is off),
// so ours must be too: the unpack then returns what it holds -- a kept tensor as it is now, an
// offloaded one as it was saved (what save_on_cpu returns on a GPU). Read only on the path where
// the version check would raise, so it costs nothing otherwise.
// "As it was saved" needs the copy to read the bytes before the region's next op can write
// them: a side-stream copy, or a batch copied at context exit, would race with that write (and
// return the bytes as written, or half of them). So a tensor SAC caches (pack called from the
// cache's `wrap`, found by its code object: sac_cache_pack, Note [Torch internals]) is copied on
// its own, on the current stream: after the op that made it, before any op after it.

// Note [DTensor activations]
// Under tensor parallelism (torch.distributed.tensor) the tensors autograd saves are DTensors:
// wrapper subclasses whose own storage holds nothing, with the data in a plain local tensor
// (`_local_tensor`, this rank's shard or replica) and the layout in a spec (`_spec`: mesh,
// placements, global shape and strides). Pack offloads the local tensor through the same path as
// any saved tensor -- several DTensor views of one local storage are copied once, and the
// version check runs on the local tensor's counter, which an in-place op on the DTensor bumps
// (DTensor runs the op on the local tensor) -- and keeps the spec; unpack builds the DTensor
// again from the reloaded local tensor and the spec. The local tensor of a DTensor computed by an
// op is always a leaf (DTensor computes below autograd), so the parameter lookup runs on the
// DTensor: a DTensor parameter, or a view of one, is kept as a parameter. Every other
// __torch_dispatch__ subclass is kept (KeepReason::Subclass): its storage is not its data.
// Only exactly DTensor: a subclass of it may hold more than its local tensor and spec.
namespace {

// True while pack_dtensor packs the local tensor of a DTensor that is an activation: that local
// tensor is a leaf, but no parameter or buffer (Note [DTensor activations]).
thread_local bool t_local_of_activation = false;

}  // namespace

py::object Packer::pack_dtensor(py::handle obj, const at::Tensor& t, int64_t nbytes) {
  PyObject* cls = dtensor_class();
  if (!cls || Py_TYPE(obj.ptr()) != reinterpret_cast<PyTypeObject*>(cls)) return py::object();
  const at::TensorBase& root = t.is_view() ? t._base() : static_cast<const at::TensorBase&>(t);
  const bool leaf = root.is_leaf();
  if (leaf) {
    PyObject* root_obj = THPVariable_Wrap(root);
    const bool param = root_obj && dtensor_is_param(root_obj);
    Py_XDECREF(root_obj);
    PyErr_Clear();
    if (param) return keep(t, KeepReason::Parameter, nbytes);
  }
  py::object local = dtensor_local_tensor(obj);
  py::object spec = dtensor_spec(obj);
  py::object inner;
  {
    const bool outer = t_local_of_activation;
    t_local_of_activation = !leaf;
    try {
      inner = pack(local);
    } catch (...) {
      t_local_of_activation = outer;
      throw;
    }
    t_local_of_activation = outer;
  }
  return make_saved_dtensor(t, std::move(inner), std::move(spec));
}

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
  if (refused && options_.raise_on_full) throw batch_refused(why, *options_.pool, refused, refused_bytes);
}

void Packer::begin() {
  if (prefetcher_) prefetcher_->mark_block();  // each activation is a block (Note [Prefetch window])
  keep_rules_.clear();
}

void Packer::end(bool keep_dedup) {
  std::exception_ptr flush_error;
  try {
    flush_batches();
  } catch (...) {
    flush_error = std::current_exception();
  }
  if (!keep_dedup) tables_.clear();
  keep_rules_.clear();
  engine().poll();
  if (flush_error) std::rethrow_exception(flush_error);
}

py::object Packer::keep(const at::Tensor& t, KeepReason why, int64_t nbytes) {
  counters_->kept_tensors[static_cast<int>(why)]++;
  counters_->kept_bytes[static_cast<int>(why)] += nbytes;
  // A detached alias: same storage and version counter, but no grad_fn, so an output saved
  // by its own node does not form a reference cycle that would leak the graph. For a plain
  // strided tensor made directly (what the detach op does, without its dispatch); subclasses
  // and other layouts go through their own detach. Some are held as they are (Note [Kept as it is]).
  at::Tensor alias;
  if (why == KeepReason::Subclass || why == KeepReason::Layout || why == KeepReason::NoData ||
      t.key_set().has(c10::DispatchKey::Python)) {
    alias = t.detach();
  } else if (KeepRules::held_as_it_is(t, why)) {
    alias = t;
  } else {
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    alias = at::Tensor(impl->shallow_copy_and_detach(impl->version_counter(), impl->allow_tensor_metadata_change()));
  }
  // Parameters, buffers and autocast's cached casts live across the step anyway: not counted
  // as saved activations in the memory timeline.
  const bool lives_anyway =
      why == KeepReason::Parameter || why == KeepReason::Buffer || why == KeepReason::AutocastCast;
  py::object saved =
      make_saved(SavedTensor::KeptTag{}, t, std::move(alias), nbytes, lives_anyway ? 0 : nbytes, counters_);
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
  counters_->note_device_peak();
  return saved;
}

std::optional<KeepReason> Packer::classify(PyObject* o, const at::Tensor& t, Span* span, int64_t* keep_bytes,
                                           std::optional<CurrentStream>* current) {
  const c10::TensorImpl& impl = *t.unsafeGetTensorImpl();
  const int64_t itemsize = static_cast<int64_t>(impl.dtype().itemsize());
  *keep_bytes = impl.numel() * itemsize;
  int64_t extent = 0;  // elements of its storage it reaches (extent_elements)
  // The usual case first: torch.Tensor's own class (not a Parameter, which THPVariable_CheckExact
  // also accepts, nor any other subclass), plainly strided. For it the checks below conclude "no
  // parameter object, no subclass, a supported layout, not a ZeroTensor"; what is left of
  // without_data is the storage test.
  if (Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(THPVariableClass) && plain_strided(impl)) {
    extent = extent_elements(impl);
    if (storage_lacks_span(impl, extent)) {
      *keep_bytes = 0;  // Note [Tensors without data]
      return KeepReason::NoData;
    }
  } else {
    if (KeepRules::is_parameter(o)) return KeepReason::Parameter;
    if (!THPVariable_CheckExact(o) || wrapped_tensor(t)) return KeepReason::Subclass;
    if (unsupported_layout(t)) return KeepReason::Layout;
    if (without_data(t)) {  // Note [Tensors without data]: nothing to copy, nothing held
      *keep_bytes = 0;
      return KeepReason::NoData;
    }
    extent = extent_elements(t);
  }
  const c10::Device device = impl.device();
  const bool device_ok = (device.is_cpu() && options_.offload_cpu) || (device.is_cuda() && options_.offload_cuda);
  if (!device_ok) return KeepReason::Device;
  // Under CUDA graph capture events cannot be queried and the pool's addresses would be baked
  // into the graph: leave such tensors alone.
  current->emplace(CurrentStream::of(device));
  if ((*current)->capturing()) return KeepReason::GraphCapture;

  // Note [Parameters and buffers]. An activation (the root of its views has a grad_fn) costs
  // one flag test here; under autocast a cast of a parameter is a low-precision float.
  const at::TensorBase& root = t.is_view() ? t._base() : static_cast<const at::TensorBase&>(t);
  if (root.is_leaf()) {
    if (!t_local_of_activation)
      if (auto why = keep_rules_.leaf_owner(t, root)) return why;
  } else if (KeepRules::autocast_cast(root)) {
    return KeepReason::AutocastCast;
  }

  if (extent == 0) {
    *keep_bytes = 0;
    return KeepReason::TooSmall;
  }
  span->itemsize = itemsize;
  span->lo = impl.storage_offset() * itemsize;
  span->hi = span->lo + extent * itemsize;
  if (span->bytes() < options_.min_bytes) {
    *keep_bytes = span->bytes();
    return KeepReason::TooSmall;
  }
  const auto& vc = impl.version_counter();
  span->version = vc.enabled() ? vc.current_version() : 0;
  return std::nullopt;
}

std::shared_ptr<OffloadedStorage> Packer::join(const at::Tensor& t, const Span& span, const Span& wide,
                                               std::vector<CopyTables::Touched>& touched, const CurrentStream& current,
                                               TieredRefusal* refused) {
  for (const auto& g : touched)
    if (!g.extendable || !g.held->extendable()) return nullptr;
  std::sort(touched.begin(), touched.end(),
            [](const CopyTables::Touched& a, const CopyTables::Touched& b) { return a.lo < b.lo; });
  // The bytes of `wide` no copy holds: below the first, between copies, above the last. Every
  // copy touched shares a cell with `wide`, so the union is one span.
  const int64_t lo = std::min(wide.lo, touched.front().lo);
  int64_t hi = lo;
  std::vector<std::pair<int64_t, int64_t>> missing;
  for (const auto& g : touched) {
    if (g.lo > hi) missing.emplace_back(hi, g.lo);
    hi = std::max(hi, g.hi);
  }
  if (wide.hi > hi) missing.emplace_back(hi, wide.hi);
  hi = std::max(hi, wide.hi);
  const std::shared_ptr<OffloadedStorage>& target = touched.front().held;
  std::vector<OffloadedStorage::Piece> pieces;
  for (const auto& m : missing) {
    // Copied as pieces of the first copy: the same handle in the profile.
    auto buffer =
        offload_bytes(t, m.first, m.second, options_.pool, options_.side_stream, &current, target->handle(), refused);
    if (!buffer) return nullptr;
    if (buffer->spilled()) counters_->bytes_spilled += m.second - m.first;
    pieces.push_back(OffloadedStorage::Piece{std::move(buffer), m.first});
  }
  int64_t counted = 0;
  auto joined = tables_.join(t, span, touched, std::move(pieces), lo, hi, &counted);
  if (joined) {
    counters_->bytes_offloaded += counted;
    counters_->bytes_stored += counted;
  }
  return joined;
}

std::shared_ptr<OffloadedStorage> Packer::batch(const at::Tensor& t, const Span& span, const CurrentStream& current) {
  const int key = device_index(t.device());
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
      if (!open)
        open = std::make_shared<Batch>(t.device(), options_.side_stream, options_.pool, counters_, prefetcher_);
      batch = open;
    }
    if (full && !full->flush() && options_.raise_on_full)
      throw batch_refused(full->refusal(), *options_.pool, full->size(), full->block_bytes());
    // Null when an unpack flushed the batch meanwhile: take a new one.
    if (auto storage = batch->add(t, span.lo, span.bytes(), current)) {
      counters_->tensors_batched++;
      return storage;
    }
  }
}

Packer::Placed Packer::place(const at::Tensor& t, const Span& span, const Span& wide, const CurrentStream& current,
                             bool from_sac_cache, Placement* how, TieredRefusal* refused) {
  Placed p;
  // Note [Selective checkpoint cache mutation]: a tensor SAC caches is copied now, on its own,
  // when a copy could be late (side stream, batches).
  if ((options_.side_stream || options_.batch_below > 0) && from_sac_cache) {
    p.storage = copy_to_host(t, options_.pool, /*side_stream=*/false, counters_, refused, &current, wide.lo, wide.hi);
    *how = Placement::Single;
    return p;
  }
  // Exact copies of this storage first: one that holds the span, or those that share its cells.
  std::vector<CopyTables::Touched> touched;
  if ((p.storage = tables_.find_exact(t, span, wide, &touched))) {
    *how = Placement::Duplicate;
    return p;
  }
  if (!touched.empty()) {
    if ((p.storage = join(t, span, wide, touched, current, refused))) {
      *how = Placement::Joined;
      return p;
    }
    if (*refused != TieredRefusal::None) return p;
  }
  // Note [Low-precision storage]: converted tensors take the single-copy path, and are
  // remembered apart (their host bytes are not the storage's): only a later tensor of exactly
  // the same span shares a narrow copy.
  std::optional<lowp::Source> narrow;
  if (options_.store_format != lowp::Format::None && span.bytes() >= options_.store_min_bytes)
    narrow = store_source(t, options_.store_format);
  if (narrow) {
    if ((p.copy = tables_.find_converted(t, span))) {
      *how = Placement::SharedConverted;
      return p;
    }
    p.copy = convert_to_host(t, *narrow, options_.store_format, options_.pool, options_.side_stream, counters_, refused,
                             &current, options_.measure_error ? store_errors_.get() : nullptr);
    if (p.copy && prefetcher_) p.copy->staged()->set_order(prefetcher_, prefetcher_->add(p.copy->staged()));
    *how = Placement::Converted;
    return p;
  }
  if (options_.batch_below > 0 && span.bytes() < options_.batch_below) {
    *how = Placement::Batched;
    p.storage = batch(t, span, current);
    return p;
  }
  p.storage = copy_to_host(t, options_.pool, options_.side_stream, counters_, refused, &current, wide.lo, wide.hi);
  *how = Placement::Single;
  p.prefetch = p.storage && prefetcher_;
  return p;
}

void Packer::remember(const at::Tensor& t, const Span& span, const Span& wide, const Placed& placed, Placement how) {
  if (how == Placement::Converted) {
    tables_.add_converted(t, span, placed.copy);
    return;
  }
  // A batch member's copy is its span, and cannot grow; a copy of its own is the widened span.
  const bool own = how == Placement::Single;
  tables_.add_exact(t, span, own ? wide : span, placed.storage, own);
}

py::object Packer::refuse(const at::Tensor& t, TieredRefusal why, int64_t bytes) {
  if (options_.raise_on_full) throw pool_full(why, *options_.pool, saved_tensor_name(t), bytes);
  return keep(t, why == TieredRefusal::DiskFull ? KeepReason::DiskFull : KeepReason::PoolFull, bytes);
}

py::object Packer::pack(py::handle obj) {
  PyObject* o = obj.ptr();
  if (!THPVariable_Check(o)) return py::reinterpret_borrow<py::object>(obj);
  const at::Tensor& t = THPVariable_Unpack(o);
  Span span;
  int64_t keep_bytes = 0;
  std::optional<CurrentStream> current;
  if (auto why = classify(o, t, &span, &keep_bytes, &current)) {
    if (*why == KeepReason::Subclass)
      if (py::object d = pack_dtensor(obj, t, keep_bytes)) return d;
    return keep(t, *why, keep_bytes);
  }
  // Note [One copy per storage]: the span widened to the 512-byte cells of its storage.
  Span wide = span;
  wide.lo = span.lo / static_cast<int64_t>(kAlignment) * static_cast<int64_t>(kAlignment);
  wide.hi = std::min(static_cast<int64_t>(round_up(static_cast<size_t>(span.hi), kAlignment)),
                     static_cast<int64_t>(t.storage().nbytes()));
  Placement how = Placement::Single;
  TieredRefusal refused = TieredRefusal::None;
  // A tensor torch's selective checkpoint caches (a cheap frame test) or this packer's owner does
  // unpacks to a tensor of its own (Note [Same view, same tensor]).
  const bool from_sac_cache = sac_cache_pack();
  Placed placed = place(t, span, wide, *current, from_sac_cache, &how, &refused);
  if (!placed.storage && !placed.copy) return refuse(t, refused, span.bytes());
  const bool shared = how == Placement::Duplicate || how == Placement::Joined || how == Placement::SharedConverted;
  if (shared) {
    counters_->tensors_deduplicated++;
    counters_->bytes_deduplicated += span.bytes();
  } else {
    counters_->tensors_offloaded++;
    counters_->bytes_offloaded += span.bytes();
    counters_->bytes_stored += placed.copy ? placed.copy->stored_nbytes() : span.bytes();
    if (how == Placement::Converted) counters_->tensors_converted++;
    remember(t, span, wide, placed, how);
  }
  // A joined copy copied the missing cells; a duplicate copied nothing.
  if (how != Placement::Duplicate && how != Placement::SharedConverted) {
    sample_memory(options_.pool.get(), t.device());
    counters_->note_device_peak();
  }
  if (placed.copy) return make_saved(t, std::move(placed.copy), counters_);
  std::shared_ptr<OffloadedStorage> storage = placed.prefetch ? placed.storage : nullptr;
  py::object out = make_saved(t, std::move(placed.storage), counters_);
  if (from_sac_cache || distinct_unpacks_) reinterpret_cast<SavedObject*>(out.ptr())->saved.set_distinct();
  // After the link: the prefetcher reads the bytes a saved tensor still has to unpack.
  if (storage) storage->set_order(prefetcher_, prefetcher_->add(storage));
  return out;
}

at::Tensor Packer::unpack(py::handle obj) {
  if (Py_TYPE(obj.ptr()) == saved_dtensor_type()) {  // Note [DTensor activations]
    auto* d = reinterpret_cast<SavedDTensorObject*>(obj.ptr());
    d->outer.check();
    at::Tensor local = unpack(py::handle(d->local));
    py::object local_obj = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(local)));
    // autograd gives the unpacked tensor its grad_fn or requires_grad itself.
    py::object dt = dtensor_from(local_obj, py::handle(d->spec));
    return THPVariable_Unpack(dt.ptr());
  }
  if (Py_TYPE(obj.ptr()) != saved_type()) {  // Note [Saved activation objects]
    if (THPVariable_Check(obj.ptr())) return THPVariable_Unpack(obj.ptr());
    throw py::type_error("ckpt_offload: unpack got an object that ckpt_offload did not pack");
  }
  SavedTensor& saved = reinterpret_cast<SavedObject*>(obj.ptr())->saved;
  // A tensor modified in place after it was saved raises here, before this backward has a
  // callback queued or anything of the saved tensor is touched: the raising unpack leaves the
  // state as it found it (the graph is torn down later, maybe on autograd's device thread).
  if (saved.version().modified() && sac_allows_mutation())
    saved.version().accept_modification();  // Note [Selective checkpoint cache mutation]
  saved.check_version();
  const int task = torch::autograd::get_current_graph_task_id();
  if (task >= 0 && last_graph_task_.load(std::memory_order_relaxed) != task &&
      last_graph_task_.exchange(task) != task) {
    // Once per backward: what this backward leaves behind is released when it ends, not when
    // its graph dies or the next forward offloads.
    torch::autograd::Engine::get_default_engine().queue_callback(
        [prefetcher = prefetcher_, pool = options_.pool] { end_of_backward(prefetcher, pool); });
  }
  at::Tensor out;
  try {
    out = saved.unpack();
  } catch (const DeviceCopyModified&) {
    // Note [One version per device copy]: the device copy this unpack shares was written since
    // it was made; only SAC's cache with allow_cache_entry_mutation takes it as it is now (Note
    // [Selective checkpoint cache mutation]). Nothing changed before the raise: unpack again.
    if (!sac_allows_mutation()) throw;
    out = saved.unpack(/*accept_modified=*/true);
  }
  counters_->note_device_peak();
  return out;
}

void Packer::end_of_backward(const std::shared_ptr<Prefetcher>& prefetcher, const std::shared_ptr<HostPool>& pool) {
  if (prefetcher) prefetcher->drop_unused();
  engine().poll();
  if (pool) pool->release_retired();
}

ExitCounts Packer::exit_counts() const {
  ExitCounts c;
  c.offloaded_or_shared = offloaded_or_shared();
  std::tie(c.too_small_tensors, c.too_small_bytes) = kept(KeepReason::TooSmall);
  c.device_tensors = kept(KeepReason::Device).first;
  std::tie(c.pool_full_tensors, c.pool_full_bytes) = kept(KeepReason::PoolFull);
  std::tie(c.disk_full_tensors, c.disk_full_bytes) = kept(KeepReason::DiskFull);
  return c;
}

py::dict Packer::stats() const {
  // Note [Stats table]: the keys in stats_keys()'s order, counters from the table.
  const PackerCounters& c = *counters_;
  py::dict d;
#define CKPT_OFFLOAD_COUNTER_STAT(key, merge) d[#key] = c.key.load();
  CKPT_OFFLOAD_COUNTERS(CKPT_OFFLOAD_COUNTER_STAT)
#undef CKPT_OFFLOAD_COUNTER_STAT
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
  d[stat_keys::tensors_kept] = kept;
  d[stat_keys::bytes_kept] = kept_bytes;
  d[stat_keys::kept_by_reason] = kept_by_reason;
  d[stat_keys::kept_bytes_by_reason] = kept_bytes_by_reason;
  // The window backward used last (Note [Prefetch window]); 0 without prefetch.
  d[stat_keys::prefetch_window_bytes] =
      prefetcher_ ? (prefetcher_->auto_window() ? prefetcher_->window() : options_.prefetch_bytes) : 0;
  d[stat_keys::prefetch_block_bytes] = prefetcher_ ? prefetcher_->block_bytes() : 0;
  d[stat_keys::prefetch_lead] = prefetcher_ ? prefetcher_->lead() : 0;
  d[stat_keys::store_dtype] = options_.store_format == lowp::Format::None
                                  ? py::object(py::none())
                                  : py::object(py::str(store_format_name(options_.store_format)));
  d[stat_keys::store_error] = store_errors_->to_dict();
  return d;
}

}  // namespace ckpt_offload
