// Copy runs between lists of tensors and byte ranges of host memory, planned in one native pass.
//
// The Python reference is kvstrata.client.device.check_key + plan; this does the same for the common case (every
// tensor a contiguous strided CUDA tensor of one device) at ~0.1 us per tensor instead of ~1-2 us warm (several
// times that with the host's caches cold), and stops where the Python path must take over (a CPU or bad tensor, a
// second device), so that path names the error and handles the rest. See kvstrata/ops/tensor_runs.py.
#include <Python.h>

#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <vector>

namespace {

struct Run {
  int64_t dst, src, n, segment;
  const void* alloc;
};

// Why a pass ended (the second item of each answer).
enum Stop : long long { kDone = 0, kCut = 1, kPythonPath = 2, kNoBase = 3, kFull = 4 };

bool as_i64(PyObject* o, int64_t* v) {
  *v = PyLong_AsLongLong(o);
  return !(*v == -1 && PyErr_Occurred());
}

// A new reference to a list of the ints, or nullptr (a Python error set).
PyObject* int_list(const std::vector<int64_t>& values) {
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (out == nullptr) return nullptr;
  for (size_t k = 0; k < values.size(); ++k) {
    PyObject* item = PyLong_FromLongLong(values[k]);
    if (item == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(k), item);
  }
  return out;
}

// The pass's runs, merged as planned, and the common checks of both entry points.
struct Pass {
  bool to_host, cuda;
  int64_t device_index;
  std::vector<Run> runs;

  // The key's tensors all of the wanted kind (strided, not quantized, contiguous, with storage, on one device where
  // CUDA): their total bytes in *total; false where the Python path must take the key.
  bool check(PyObject* ts, int64_t* total) {
    if (!PyList_Check(ts) && !PyTuple_Check(ts)) return false;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(ts);
    PyObject** items = PySequence_Fast_ITEMS(ts);
    int64_t sum = 0;
    int64_t index = device_index;
    try {
      for (Py_ssize_t j = 0; j < count; ++j) {
        PyObject* o = items[j];
        // Plain tensors and Parameters only: a subclass may run Python code for any attribute (which could change
        // the lists under this pass), or mean something else by them; the Python path takes it.
        if (!THPVariable_CheckExact(o)) return false;
        const at::TensorBase& t = THPVariable_Unpack(o);
        // (a lazy conjugate or negative view's bytes are not its values: the Python path refuses it)
        if (t.layout() != at::kStrided || t.is_quantized() || (cuda ? !t.is_cuda() : !t.is_cpu()) ||
            !t.is_contiguous() || !t.has_storage() || t.is_conj() || t.is_neg())
          return false;
        // what lay() reads, read here first: a tensor that cannot answer (a wrapper without data) throws now
        (void)t.data_ptr();
        (void)t.storage().data();
        if (cuda) {
          if (index < 0) {
            index = t.get_device();
          } else if (t.get_device() != index) {
            return false;  // a second device: the Python path plans it
          }
        }
        sum += static_cast<int64_t>(t.nbytes());
      }
    } catch (const std::exception&) {
      PyErr_Clear();  // a tensor subclass's Python code may have raised: its error is the Python path's to raise
      return false;   // torch refused an attribute: the Python path asks again and raises its error
    }
    device_index = index;
    *total = sum;
    return true;
  }

  // Lay the checked key's tensors along its object's bytes at host address ``host`` in ``segment``, each run merged
  // into the previous one where both sides continue it within one segment and one tensor storage.
  void lay(PyObject* ts, int64_t host, int64_t segment) {
    Py_ssize_t count = PySequence_Fast_GET_SIZE(ts);
    PyObject** items = PySequence_Fast_ITEMS(ts);
    for (Py_ssize_t j = 0; j < count; ++j) {
      const at::TensorBase& t = THPVariable_Unpack(items[j]);
      int64_t n = static_cast<int64_t>(t.nbytes());
      if (n) {
        int64_t ptr = reinterpret_cast<int64_t>(t.data_ptr());
        const void* alloc = t.storage().data();
        int64_t dst = to_host ? host : ptr, src = to_host ? ptr : host;
        Run* last = runs.empty() ? nullptr : &runs.back();
        if (last != nullptr && last->dst + last->n == dst && last->src + last->n == src && last->segment == segment &&
            last->alloc == alloc) {
          last->n += n;
        } else {
          runs.push_back(Run{dst, src, n, segment, alloc});
        }
      }
      host += n;
    }
  }

  // (dsts, srcs, sizes) as three new lists, stolen by the "N" of Py_BuildValue; false on an error.
  bool columns(PyObject** dsts, PyObject** srcs, PyObject** sizes) const {
    std::vector<int64_t> d, s, z;
    d.reserve(runs.size());
    s.reserve(runs.size());
    z.reserve(runs.size());
    for (const Run& r : runs) {
      d.push_back(r.dst);
      s.push_back(r.src);
      z.push_back(r.n);
    }
    *dsts = int_list(d);
    *srcs = *dsts ? int_list(s) : nullptr;
    *sizes = *srcs ? int_list(z) : nullptr;
    if (*sizes == nullptr) {
      Py_XDECREF(*dsts);
      Py_XDECREF(*srcs);
      return false;
    }
    return true;
  }
};

// The copy engine's batch call, as the driver's entry point cuMemcpyBatchAsync (kvstrata/ops/tensor_runs.py looks it
// up with cuGetProcAddress for the driver's ABI): declared here, so the module needs no CUDA headers to build. Its
// attributes as the driver lays them out: a source access order (1: in stream order), two location hints, flags.
struct MemLocation {
  int type, id;
};
struct MemcpyAttributes {
  int src_access_order;
  MemLocation src_hint, dst_hint;
  unsigned flags;
};
using BatchCall13 = int (*)(uint64_t*, uint64_t*, size_t*, size_t, MemcpyAttributes*, size_t*, size_t, void*);
using BatchCall12 = int (*)(uint64_t*, uint64_t*, size_t*, size_t, MemcpyAttributes*, size_t*, size_t, size_t*,
                            void*);

// Where and how a pass's runs are copied: (entry point, its ABI version, stream, runs in the first call, runs a
// call after it).
struct Copier {
  int64_t fn = 0, abi = 0, stream = 0, head = 0, chunk = 0;

  bool parse(PyObject* o) {
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 5) {
      PyErr_SetString(PyExc_TypeError, "copier: must be a tuple (entry point, abi, stream, head, chunk)");
      return false;
    }
    if (!as_i64(PyTuple_GET_ITEM(o, 0), &fn) || !as_i64(PyTuple_GET_ITEM(o, 1), &abi) ||
        !as_i64(PyTuple_GET_ITEM(o, 2), &stream) || !as_i64(PyTuple_GET_ITEM(o, 3), &head) ||
        !as_i64(PyTuple_GET_ITEM(o, 4), &chunk))
      return false;
    if (fn == 0 || head < 1 || chunk < 1 || (abi != 12080 && abi != 13000)) {
      PyErr_SetString(PyExc_ValueError, "copier: a null entry point, head or chunk below 1, or abi not 12080/13000");
      return false;
    }
    return true;
  }

  // Queue the runs' copies, ``head`` in the first driver call and ``chunk`` in each after it; the driver's error (0:
  // none), *queued the runs of the calls it took. The GIL stays held: the calls take microseconds, and a thread given
  // the GIL meanwhile could keep it for the interpreter's switch interval (5 ms) before this call's next batch.
  int issue(const std::vector<Run>& runs, int64_t* queued) const {
    size_t n = runs.size();
    std::vector<uint64_t> dsts(n), srcs(n);
    std::vector<size_t> sizes(n);
    for (size_t k = 0; k < n; ++k) {
      dsts[k] = static_cast<uint64_t>(runs[k].dst);
      srcs[k] = static_cast<uint64_t>(runs[k].src);
      sizes[k] = static_cast<size_t>(runs[k].n);
    }
    MemcpyAttributes attrs{1, {0, 0}, {0, 0}, 0};
    size_t attr_index = 0;
    size_t k = 0;
    while (k < n) {
      size_t end = std::min(n, k + static_cast<size_t>(k == 0 ? head : chunk));
      int err;
      if (abi == 13000) {
        err = reinterpret_cast<BatchCall13>(fn)(&dsts[k], &srcs[k], &sizes[k], end - k, &attrs, &attr_index, 1,
                                                reinterpret_cast<void*>(stream));
      } else {
        size_t fail = SIZE_MAX;
        err = reinterpret_cast<BatchCall12>(fn)(&dsts[k], &srcs[k], &sizes[k], end - k, &attrs, &attr_index, 1,
                                                &fail, reinterpret_cast<void*>(stream));
      }
      if (err != 0) {
        *queued = static_cast<int64_t>(k);
        return err;
      }
      k = end;
    }
    *queued = static_cast<int64_t>(n);
    return 0;
  }
};

bool check_lists(PyObject* lists, int64_t lo, int64_t hi, const char* who) {
  if (!PyList_Check(lists) && !PyTuple_Check(lists)) {
    PyErr_Format(PyExc_TypeError, "%s: tensor_lists must be a list or tuple", who);
    return false;
  }
  if (lo < 0 || lo > hi || hi > PySequence_Fast_GET_SIZE(lists)) {
    PyErr_Format(PyExc_IndexError, "%s: key range out of bounds", who);
    return false;
  }
  return true;
}

// The copies of a pass: where a copier is given (the *_copy entry points), queued on its stream, and the answer's
// (runs, err) items: the runs queued and the driver's error (0: none); else (dsts, srcs, sizes) as three lists. Both
// new references, stolen by the "N" of Py_BuildValue; false on a Python error.
bool copies(const Pass& pass, const Copier* copier, PyObject** a, PyObject** b, PyObject** c) {
  if (copier == nullptr) return pass.columns(a, b, c);
  int64_t queued = 0;
  int err = copier->issue(pass.runs, &queued);
  *a = PyLong_FromLongLong(queued);
  *b = *a ? PyLong_FromLong(err) : nullptr;
  *c = nullptr;
  if (*b == nullptr) {
    Py_XDECREF(*a);
    return false;
  }
  return true;
}

// plan(tensor_lists, locs, bases, lo, hi, max_runs, max_bytes, device_index, to_host, cuda)
//   -> (stop, why, dsts, srcs, sizes, mismatched, device_index): objects where the worker placed them.
// plan_copy(..., cuda, copier) -> (stop, why, runs, err, mismatched, device_index): the same pass, its runs queued.
template <bool kCopy>
PyObject* plan_impl(PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != (kCopy ? 11 : 10)) {
    PyErr_SetString(PyExc_TypeError, kCopy ? "plan_copy: 11 arguments" : "plan: 10 arguments");
    return nullptr;
  }
  PyObject *lists = args[0], *locs = args[1], *bases = args[2];
  int64_t lo, hi, max_runs, max_bytes, device_index;
  if (!as_i64(args[3], &lo) || !as_i64(args[4], &hi) || !as_i64(args[5], &max_runs) ||
      !as_i64(args[6], &max_bytes) || !as_i64(args[7], &device_index))
    return nullptr;
  int to_host = PyObject_IsTrue(args[8]);
  int cuda = PyObject_IsTrue(args[9]);  // the kind of tensor the pass takes (CPU: the tests' stand-in)
  if (to_host < 0 || cuda < 0 || !check_lists(lists, lo, hi, "plan")) return nullptr;
  Copier copier;
  if (kCopy && !copier.parse(args[10])) return nullptr;
  if (!PyList_Check(locs) || !PyDict_Check(bases)) {
    PyErr_SetString(PyExc_TypeError, "plan: locs must be a list, bases a dict");
    return nullptr;
  }
  if (hi > PyList_GET_SIZE(locs)) {
    PyErr_SetString(PyExc_IndexError, "plan: key range out of bounds");
    return nullptr;
  }
  Pass pass{to_host != 0, cuda != 0, device_index, {}};
  std::vector<int64_t> mismatched;
  int64_t pending = 0, i = lo;
  long long why = kDone;
  for (; i < hi; ++i) {
    PyObject* ts = PySequence_Fast_GET_ITEM(lists, i);
    PyObject* loc = PyList_GET_ITEM(locs, i);
    if (loc == Py_None) continue;  // a key with no place to copy from yet (a cold read's: copied once its lease says)
    int64_t total, segment, offset, size;
    if (!PyTuple_Check(loc) || PyTuple_GET_SIZE(loc) < 3 || !pass.check(ts, &total)) {
      why = kPythonPath;  // which names what is wrong
      break;
    }
    if (!as_i64(PyTuple_GET_ITEM(loc, 0), &segment) || !as_i64(PyTuple_GET_ITEM(loc, 1), &offset) ||
        !as_i64(PyTuple_GET_ITEM(loc, 2), &size))
      return nullptr;
    if (total != size) {
      mismatched.push_back(i);
      continue;
    }
    PyObject* base_obj = PyDict_GetItemWithError(bases, PyTuple_GET_ITEM(loc, 0));
    if (base_obj == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      why = kNoBase;  // a segment whose address the caller looks up (then calls again from this key)
      break;
    }
    int64_t base;
    if (!as_i64(base_obj, &base)) return nullptr;
    pass.lay(ts, base + offset, segment);
    pending += total;
    if (static_cast<int64_t>(pass.runs.size()) >= max_runs || pending >= max_bytes) {
      ++i;
      why = i < hi ? kCut : kDone;
      break;
    }
  }
  PyObject *a, *b, *c, *bad = int_list(mismatched);
  if (bad == nullptr) return nullptr;
  if (!copies(pass, kCopy ? &copier : nullptr, &a, &b, &c)) {
    Py_DECREF(bad);
    return nullptr;
  }
  if (kCopy)
    return Py_BuildValue("(LLNNNL)", static_cast<long long>(i), why, a, b, bad,
                         static_cast<long long>(pass.device_index));
  return Py_BuildValue("(LLNNNNL)", static_cast<long long>(i), why, a, b, c, bad,
                       static_cast<long long>(pass.device_index));
}

// lay_out(tensor_lists, lo, hi, base, head, end, mask, max_runs, max_bytes, device_index, segment, cuda)
//   -> (stop, why, dsts, srcs, sizes, totals, offsets, device_index, head): objects laid one after another from
//   ``head`` in a reservation ending at ``end``, each taking its bytes rounded up by ``mask``, copied to the host.
// lay_out_copy(..., cuda, copier) -> (stop, why, runs, err, totals, offsets, device_index, head): its runs queued.
template <bool kCopy>
PyObject* lay_out_impl(PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != (kCopy ? 13 : 12)) {
    PyErr_SetString(PyExc_TypeError, kCopy ? "lay_out_copy: 13 arguments" : "lay_out: 12 arguments");
    return nullptr;
  }
  PyObject* lists = args[0];
  int64_t lo, hi, base, head, end, mask, max_runs, max_bytes, device_index, segment;
  if (!as_i64(args[1], &lo) || !as_i64(args[2], &hi) || !as_i64(args[3], &base) || !as_i64(args[4], &head) ||
      !as_i64(args[5], &end) || !as_i64(args[6], &mask) || !as_i64(args[7], &max_runs) ||
      !as_i64(args[8], &max_bytes) || !as_i64(args[9], &device_index) || !as_i64(args[10], &segment))
    return nullptr;
  int cuda = PyObject_IsTrue(args[11]);
  if (cuda < 0 || !check_lists(lists, lo, hi, "lay_out")) return nullptr;
  Copier copier;
  if (kCopy && !copier.parse(args[12])) return nullptr;
  if (mask < 0 || (mask & (mask + 1)) != 0) {
    PyErr_SetString(PyExc_ValueError, "lay_out: mask must be a power of two less one");
    return nullptr;
  }
  Pass pass{true, cuda != 0, device_index, {}};
  std::vector<int64_t> totals, offsets;
  int64_t pending = 0, i = lo;
  long long why = kDone;
  for (; i < hi; ++i) {
    PyObject* ts = PySequence_Fast_GET_ITEM(lists, i);
    int64_t total;
    if (!pass.check(ts, &total)) {
      why = kPythonPath;
      break;
    }
    int64_t room = (total + mask) & ~mask;
    if (head + room > end) {
      why = kFull;  // the rest go another way
      break;
    }
    pass.lay(ts, base + head, segment);
    totals.push_back(total);
    offsets.push_back(head);
    head += room;
    pending += total;
    if (static_cast<int64_t>(pass.runs.size()) >= max_runs || pending >= max_bytes) {
      ++i;
      why = i < hi ? kCut : kDone;
      break;
    }
  }
  PyObject *a, *b, *c, *t = int_list(totals), *o = t ? int_list(offsets) : nullptr;
  if (o == nullptr) {
    Py_XDECREF(t);
    return nullptr;
  }
  if (!copies(pass, kCopy ? &copier : nullptr, &a, &b, &c)) {
    Py_DECREF(t);
    Py_DECREF(o);
    return nullptr;
  }
  if (kCopy)
    return Py_BuildValue("(LLNNNNLL)", static_cast<long long>(i), why, a, b, t, o,
                         static_cast<long long>(pass.device_index), static_cast<long long>(head));
  return Py_BuildValue("(LLNNNNNLL)", static_cast<long long>(i), why, a, b, c, t, o,
                       static_cast<long long>(pass.device_index), static_cast<long long>(head));
}

// CRC-32 (IEEE 802.3, reflected: zlib's crc32) of n bytes, as every process hashes a key into the placement table.
uint32_t crc32(const unsigned char* p, Py_ssize_t n) {
  static const std::vector<uint32_t> table = [] {
    std::vector<uint32_t> t(256);
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = 0xFFFFFFFFu;
  for (Py_ssize_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFFu] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

// A Python buffer held while in scope: the table cannot be unmapped under a read of it.
struct HeldBuffer {
  Py_buffer view{};
  bool held = false;
  bool get(PyObject* o) { return held = PyObject_GetBuffer(o, &view, PyBUF_SIMPLE) == 0; }
  ~HeldBuffer() {
    if (held) PyBuffer_Release(&view);
  }
};

// A new reference: key's hint from the table's words (see hints_impl), or None; nullptr on a Python error.
PyObject* hint_of(const volatile uint64_t* words, uint64_t buckets, PyObject* key, PyObject* limits) {
  Py_ssize_t n = 0;
  const char* raw = PyUnicode_Check(key) ? PyUnicode_AsUTF8AndSize(key, &n) : nullptr;
  if (raw == nullptr) {
    PyErr_Clear();  // not a str, or not encodable: no hint (the call's key check names it)
    Py_RETURN_NONE;
  }
  const uint32_t crc = crc32(reinterpret_cast<const unsigned char*>(raw), n);
  const uint64_t at = (crc & (buckets - 1)) * 4;
  const uint64_t tag = (uint64_t{1} << 63) | (static_cast<uint64_t>(n & 0xFFFF) << 32) | crc;
  if (words[at] != tag) Py_RETURN_NONE;
  const uint64_t where = words[at + 1], size = words[at + 2], placed = words[at + 3];
  const uint64_t segment = where >> 48, offset = where & ((uint64_t{1} << 48) - 1);
  PyObject* seg_obj = PyLong_FromUnsignedLongLong(segment);
  if (seg_obj == nullptr) return nullptr;
  if (limits != Py_None) {  // only where a copy may start from it
    PyObject* limit_obj = PyDict_GetItemWithError(limits, seg_obj);  // borrowed
    int64_t limit = -1;
    if ((limit_obj == nullptr && PyErr_Occurred()) || (limit_obj != nullptr && !as_i64(limit_obj, &limit))) {
      Py_DECREF(seg_obj);
      return nullptr;
    }
    const uint64_t end = static_cast<uint64_t>(limit);
    if (placed == 0 || limit < 0 || size > end || offset > end - size) {
      Py_DECREF(seg_obj);
      Py_RETURN_NONE;
    }
  }
  using ull = unsigned long long;
  return Py_BuildValue("(NKKK)", seg_obj, static_cast<ull>(offset), static_cast<ull>(size), static_cast<ull>(placed));
}

// hints(table, keys, lo, hi, limits) -> [(segment, offset, size, placement) or None per key lo..hi-1]: the
// placement table's buckets for the keys (kvstrata.store.placements: four words a bucket, [tag, segment << 48 |
// offset, size, placement]), as PlacementHints.lookup reads them; with ``limits`` (not None), kept only where a copy
// may start from them: a placement (not 0) in a segment of ``limits`` (index -> bytes mapped) whose range lies within
// it. ``table`` is the mapped table's buffer, held for the call (the table cannot be unmapped under it). Advice: a
// bucket's words are read one by one while the worker may write them, as in Python; the lease says whether a copy
// stands.
PyObject* hints_impl(PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "hints: 5 arguments");
    return nullptr;
  }
  PyObject *keys = args[1], *limits = args[4];
  int64_t lo, hi;
  if (!as_i64(args[2], &lo) || !as_i64(args[3], &hi)) return nullptr;
  if (!PyList_Check(keys) || (limits != Py_None && !PyDict_Check(limits))) {
    PyErr_SetString(PyExc_TypeError, "hints: keys must be a list, limits a dict or None");
    return nullptr;
  }
  if (lo < 0 || lo > hi || hi > PyList_GET_SIZE(keys)) {
    PyErr_SetString(PyExc_IndexError, "hints: key range out of bounds");
    return nullptr;
  }
  HeldBuffer table;
  if (!table.get(args[0])) return nullptr;
  const uint64_t buckets = static_cast<uint64_t>(table.view.len) / 32;
  if (buckets == 0 || (buckets & (buckets - 1)) != 0) {
    PyErr_SetString(PyExc_ValueError, "hints: the table must hold a power of two of 32-byte buckets");
    return nullptr;
  }
  const volatile uint64_t* words = static_cast<const volatile uint64_t*>(table.view.buf);
  PyObject* out = PyList_New(hi - lo);
  if (out == nullptr) return nullptr;
  for (int64_t i = lo; i < hi; ++i) {
    PyObject* hint = hint_of(words, buckets, PyList_GET_ITEM(keys, i), limits);
    if (hint == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, i - lo, hint);
  }
  return out;
}

// current_prefix(entries, keys, gen, slots, nslots) -> [location of each key, from the first, while its entry is
// current]: LocalReads.entries_prefix's test (kvstrata/client/local_reads.py) in one native call. ``entries`` maps a
// key to its entry ``[lease, location, slot, count, seen]``; an entry is current where ``seen`` is the generation
// ``gen`` (read by the caller before this call), or where the worker's counter ``slots[slot]`` (``nslots`` 8-byte
// counters at address ``slots``, shared memory the worker writes) still shows ``count``, and then ``seen`` becomes
// ``gen``, as in Python. Stops at the first key with no entry (a key not a str included: the caller's key check
// names it) or a stale one, which is left as it is.
PyObject* current_prefix_impl(PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "current_prefix: 5 arguments");
    return nullptr;
  }
  PyObject *entries = args[0], *keys = args[1], *gen_obj = args[2];
  if (!PyDict_Check(entries) || !PyList_Check(keys) || !PyLong_Check(gen_obj)) {
    PyErr_SetString(PyExc_TypeError, "current_prefix: entries must be a dict, keys a list, gen an int");
    return nullptr;
  }
  const unsigned long long gen = PyLong_AsUnsignedLongLong(gen_obj);
  int64_t slots_address, nslots;
  if ((gen == static_cast<unsigned long long>(-1) && PyErr_Occurred()) || !as_i64(args[3], &slots_address) ||
      !as_i64(args[4], &nslots))
    return nullptr;
  if (slots_address == 0 || nslots < 0) {
    PyErr_SetString(PyExc_ValueError, "current_prefix: a null slots address or a negative count");
    return nullptr;
  }
  const volatile uint64_t* slots = reinterpret_cast<const volatile uint64_t*>(slots_address);
  const Py_ssize_t n = PyList_GET_SIZE(keys);
  std::vector<PyObject*> found;  // borrowed: the entries' locations
  found.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* key = PyList_GET_ITEM(keys, i);
    if (!PyUnicode_CheckExact(key)) break;  // a str's lookup runs no Python code
    PyObject* entry = PyDict_GetItemWithError(entries, key);  // borrowed
    if (entry == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      break;
    }
    if (!PyList_CheckExact(entry) || PyList_GET_SIZE(entry) < 5) break;
    const unsigned long long seen = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(entry, 4));
    if (seen == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return nullptr;
    if (seen != gen) {
      int64_t slot, count;
      if (!as_i64(PyList_GET_ITEM(entry, 2), &slot) || !as_i64(PyList_GET_ITEM(entry, 3), &count)) return nullptr;
      if (slot < 0 || slot >= nslots || slots[slot] != static_cast<uint64_t>(count)) break;
      Py_INCREF(gen_obj);  // unchanged at a moment after gen was read: any later change moves gen
      PyList_SetItem(entry, 4, gen_obj);
    }
    found.push_back(PyList_GET_ITEM(entry, 1));
  }
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(found.size()));
  if (out == nullptr) return nullptr;
  for (size_t k = 0; k < found.size(); ++k) {
    Py_INCREF(found[k]);
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(k), found[k]);
  }
  return out;
}

// The driver's stream calls a copy stream's start makes (looked up like cuMemcpyBatchAsync): cuStreamQuery,
// cuEventRecord, cuStreamWaitEvent. CUDA_ERROR_NOT_READY: the stream has work pending.
using StreamQuery = int (*)(void*);
using EventRecord = int (*)(void*, void*);
using StreamWaitEvent = int (*)(void*, void*, unsigned);
constexpr int kNotReady = 600;

// join(calls, caller, side, event, skip_idle) -> (state, err): ``side`` made to wait for the work queued on the raw
// stream ``caller`` so far, as kvstrata.client.device.start does it (state 1: ``event`` recorded on ``caller``, and
// ``side`` waits for it), or, with ``skip_idle``, nothing where ``caller`` has nothing pending (state 0: one query).
// State 2, having queued nothing: a wait is needed and ``event`` is 0 (the caller creates the event). ``err``: the
// driver's error (0: none). ``calls`` are the three entry points' addresses.
PyObject* join_impl(PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "join: 5 arguments");
    return nullptr;
  }
  PyObject* calls = args[0];
  int64_t query, record, wait, caller, side, event;
  if (!PyTuple_Check(calls) || PyTuple_GET_SIZE(calls) != 3) {
    PyErr_SetString(PyExc_TypeError, "join: calls must be a tuple (cuStreamQuery, cuEventRecord, cuStreamWaitEvent)");
    return nullptr;
  }
  if (!as_i64(PyTuple_GET_ITEM(calls, 0), &query) || !as_i64(PyTuple_GET_ITEM(calls, 1), &record) ||
      !as_i64(PyTuple_GET_ITEM(calls, 2), &wait) || !as_i64(args[1], &caller) || !as_i64(args[2], &side) ||
      !as_i64(args[3], &event))
    return nullptr;
  const int skip_idle = PyObject_IsTrue(args[4]);
  if (skip_idle < 0) return nullptr;
  if (query == 0 || record == 0 || wait == 0 || side == 0) {
    PyErr_SetString(PyExc_ValueError, "join: a null entry point or side stream");
    return nullptr;
  }
  auto* caller_stream = reinterpret_cast<void*>(caller);
  if (skip_idle) {
    const int err = reinterpret_cast<StreamQuery>(query)(caller_stream);
    if (err == 0) return Py_BuildValue("(ii)", 0, 0);
    if (err != kNotReady) return Py_BuildValue("(ii)", 0, err);
  }
  if (event == 0) return Py_BuildValue("(ii)", 2, 0);
  int err = reinterpret_cast<EventRecord>(record)(reinterpret_cast<void*>(event), caller_stream);
  if (err == 0)
    err = reinterpret_cast<StreamWaitEvent>(wait)(reinterpret_cast<void*>(side), reinterpret_cast<void*>(event), 0);
  return Py_BuildValue("(ii)", 1, err);
}

// A C++ exception must not cross into the interpreter (it would end the process): it becomes a RuntimeError.
template <PyObject* (*impl)(PyObject* const*, Py_ssize_t)>
PyObject* guarded(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  try {
    return impl(args, nargs);
  } catch (const std::exception& e) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, e.what());  // else Python code raised: that error
  } catch (...) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "kvstrata_tensor_runs: an unknown C++ exception");
  }
  return nullptr;
}

// Each entry point is its implementation behind guarded<>.
#define KVSTRATA_FASTCALL(impl) \
  reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(&guarded<impl>)), METH_FASTCALL

PyMethodDef methods[] = {
    {"plan", KVSTRATA_FASTCALL(plan_impl<false>),
     "plan(tensor_lists, locs, bases, lo, hi, max_runs, max_bytes, device_index, to_host, cuda) -> "
     "(stop, why, dsts, srcs, sizes, mismatched, device_index)"},
    {"plan_copy", KVSTRATA_FASTCALL(plan_impl<true>),
     "plan_copy(tensor_lists, locs, bases, lo, hi, max_runs, max_bytes, device_index, to_host, cuda, copier) -> "
     "(stop, why, runs, err, mismatched, device_index)"},
    {"lay_out", KVSTRATA_FASTCALL(lay_out_impl<false>),
     "lay_out(tensor_lists, lo, hi, base, head, end, mask, max_runs, max_bytes, device_index, segment, cuda) -> "
     "(stop, why, dsts, srcs, sizes, totals, offsets, device_index, head)"},
    {"lay_out_copy", KVSTRATA_FASTCALL(lay_out_impl<true>),
     "lay_out_copy(tensor_lists, lo, hi, base, head, end, mask, max_runs, max_bytes, device_index, segment, cuda, "
     "copier) -> (stop, why, runs, err, totals, offsets, device_index, head)"},
    {"hints", KVSTRATA_FASTCALL(hints_impl),
     "hints(table, keys, lo, hi, limits) -> [(segment, offset, size, placement) or None per key]"},
    {"current_prefix", KVSTRATA_FASTCALL(current_prefix_impl),
     "current_prefix(entries, keys, gen, slots, nslots) -> [location of each key from the first while current]"},
    {"join", KVSTRATA_FASTCALL(join_impl), "join(calls, caller, side, event, skip_idle) -> (state, err)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvstrata_tensor_runs", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_kvstrata_tensor_runs(void) { return PyModule_Create(&module); }
