// Copy runs between lists of tensors and byte ranges of host memory, planned in one native pass.
//
// The Python reference is kvstrata.client.device.check_key + plan; this does the same for the common case (every
// tensor a contiguous strided CUDA tensor of one device) at ~0.1 us per tensor instead of ~1-2 us warm (several
// times that with the host's caches cold), and stops where the Python path must take over (a CPU or bad tensor, a
// second device), so that path names the error and handles the rest. See kvstrata/ops/tensor_runs.py.
#include <Python.h>

#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <vector>

namespace {

struct Run {
  int64_t dst, src, n, segment;
  const void* alloc;
};

// A new reference to a list of the column's ints.
PyObject* column(const std::vector<Run>& runs, int which) {
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(runs.size()));
  if (out == nullptr) return nullptr;
  for (size_t k = 0; k < runs.size(); ++k) {
    const Run& r = runs[k];
    int64_t v = which == 0 ? r.dst : which == 1 ? r.src : r.n;
    PyObject* item = PyLong_FromLongLong(v);
    if (item == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(k), item);
  }
  return out;
}

bool as_i64(PyObject* o, int64_t* v) {
  *v = PyLong_AsLongLong(o);
  return !(*v == -1 && PyErr_Occurred());
}

// Why a pass ended (the second item of plan's answer).
enum Stop : long long { kDone = 0, kCut = 1, kPythonPath = 2, kNoBase = 3 };

// plan(tensor_lists, locs, bases, lo, hi, max_runs, max_bytes, device_index, to_host, cuda)
//   -> (stop, why, dsts, srcs, sizes, mismatched, device_index); see tensor_runs.py.
PyObject* plan(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 10) {
    PyErr_SetString(PyExc_TypeError, "plan: 10 arguments");
    return nullptr;
  }
  PyObject *lists = args[0], *locs = args[1], *bases = args[2];
  int64_t lo, hi, max_runs, max_bytes, device_index;
  if (!as_i64(args[3], &lo) || !as_i64(args[4], &hi) || !as_i64(args[5], &max_runs) ||
      !as_i64(args[6], &max_bytes) || !as_i64(args[7], &device_index))
    return nullptr;
  int to_host = PyObject_IsTrue(args[8]);
  int cuda = PyObject_IsTrue(args[9]);  // the kind of tensor the pass takes (CPU: the tests' stand-in)
  if (to_host < 0 || cuda < 0) return nullptr;
  if (!PyList_Check(lists) && !PyTuple_Check(lists)) {
    PyErr_SetString(PyExc_TypeError, "plan: tensor_lists must be a list or tuple");
    return nullptr;
  }
  if (!PyList_Check(locs) || !PyDict_Check(bases)) {
    PyErr_SetString(PyExc_TypeError, "plan: locs must be a list, bases a dict");
    return nullptr;
  }
  if (lo < 0 || hi > PySequence_Fast_GET_SIZE(lists) || hi > PyList_GET_SIZE(locs)) {
    PyErr_SetString(PyExc_IndexError, "plan: key range out of bounds");
    return nullptr;
  }
  std::vector<Run> runs;
  runs.reserve(static_cast<size_t>(max_runs > 0 ? max_runs : 16) + 8);
  PyObject* mismatched = PyList_New(0);
  if (mismatched == nullptr) return nullptr;
  int64_t pending = 0;
  int64_t i = lo;
  long long why = kDone;
  for (; i < hi; ++i) {
    PyObject* ts = PySequence_Fast_GET_ITEM(lists, i);
    PyObject* loc = PyList_GET_ITEM(locs, i);
    if ((!PyList_Check(ts) && !PyTuple_Check(ts)) || !PyTuple_Check(loc) || PyTuple_GET_SIZE(loc) < 3) {
      why = kPythonPath;  // which names what is wrong
      break;
    }
    int64_t segment, offset, size;
    if (!as_i64(PyTuple_GET_ITEM(loc, 0), &segment) || !as_i64(PyTuple_GET_ITEM(loc, 1), &offset) ||
        !as_i64(PyTuple_GET_ITEM(loc, 2), &size)) {
      Py_DECREF(mismatched);
      return nullptr;
    }
    // Check the key's tensors first: a key is planned whole or not at all.
    Py_ssize_t count = PySequence_Fast_GET_SIZE(ts);
    PyObject** items = PySequence_Fast_ITEMS(ts);
    int64_t total = 0;
    bool python_path = false;
    for (Py_ssize_t j = 0; j < count; ++j) {
      PyObject* o = items[j];
      if (!THPVariable_Check(o)) {
        python_path = true;
        break;
      }
      const at::TensorBase& t = THPVariable_Unpack(o);
      if (t.layout() != at::kStrided || t.is_quantized() || (cuda ? !t.is_cuda() : !t.is_cpu()) ||
          !t.is_contiguous() || !t.has_storage()) {
        python_path = true;
        break;
      }
      if (cuda) {
        int64_t index = t.get_device();
        if (device_index < 0) {
          device_index = index;
        } else if (index != device_index) {
          python_path = true;  // a second device: the Python path plans it
          break;
        }
      }
      total += static_cast<int64_t>(t.nbytes());
    }
    if (python_path) {
      why = kPythonPath;
      break;
    }
    if (total != size) {
      PyObject* k = PyLong_FromLongLong(i);
      if (k == nullptr || PyList_Append(mismatched, k) < 0) {
        Py_XDECREF(k);
        Py_DECREF(mismatched);
        return nullptr;
      }
      Py_DECREF(k);
      continue;
    }
    PyObject* seg_key = PyTuple_GET_ITEM(loc, 0);
    PyObject* base_obj = PyDict_GetItemWithError(bases, seg_key);
    if (base_obj == nullptr) {
      if (PyErr_Occurred()) {
        Py_DECREF(mismatched);
        return nullptr;
      }
      why = kNoBase;  // a segment whose address the caller looks up (then calls again from this key)
      break;
    }
    int64_t host;
    if (!as_i64(base_obj, &host)) {
      Py_DECREF(mismatched);
      return nullptr;
    }
    host += offset;
    for (Py_ssize_t j = 0; j < count; ++j) {
      const at::TensorBase& t = THPVariable_Unpack(items[j]);
      int64_t n = static_cast<int64_t>(t.nbytes());
      if (n) {
        int64_t ptr = reinterpret_cast<int64_t>(t.data_ptr());
        const void* alloc = t.storage().data();
        int64_t dst = to_host ? host : ptr, src = to_host ? ptr : host;
        if (!runs.empty()) {
          Run& last = runs.back();
          if (last.dst + last.n == dst && last.src + last.n == src && last.segment == segment && last.alloc == alloc) {
            last.n += n;
            host += n;
            continue;
          }
        }
        runs.push_back(Run{dst, src, n, segment, alloc});
      }
      host += n;
    }
    pending += total;
    if (static_cast<int64_t>(runs.size()) >= max_runs || pending >= max_bytes) {
      ++i;
      why = i < hi ? kCut : kDone;
      break;
    }
  }
  PyObject* dsts = column(runs, 0);
  PyObject* srcs = dsts ? column(runs, 1) : nullptr;
  PyObject* sizes = srcs ? column(runs, 2) : nullptr;
  if (sizes == nullptr) {
    Py_XDECREF(dsts);
    Py_XDECREF(srcs);
    Py_DECREF(mismatched);
    return nullptr;
  }
  return Py_BuildValue("(LLNNNNL)", static_cast<long long>(i), why, dsts, srcs, sizes, mismatched,
                       static_cast<long long>(device_index));
}

PyMethodDef methods[] = {
    {"plan", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(plan)), METH_FASTCALL,
     "plan(tensor_lists, locs, bases, lo, hi, max_runs, max_bytes, device_index, to_host, cuda) -> "
     "(stop, why, dsts, srcs, sizes, mismatched, device_index)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvstrata_tensor_runs", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_kvstrata_tensor_runs(void) { return PyModule_Create(&module); }
