/* paged_attention.c as a Python extension module: the same four functions, under the same names,
 * taking what hal.backends.cpu.native passes the ctypes library (ints for pointers, sizes and
 * strides, None for a null pointer, a float scale). Why: a call through ctypes converts each
 * argument by its declared type, about 2.4 us for a layer call's 22 arguments and several times
 * that when an engine's other work has left ctypes out of the processor's caches; here they are
 * read straight from the call's argument vector (about 0.2 us). Built by native.py where the
 * interpreter's headers are installed; elsewhere the ctypes library serves. The GIL is released
 * while a layer call runs, as ctypes does. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>

#include "paged_attention.c"

/* Each reader: 0, or -1 with a Python exception set (TypeError, OverflowError) naming the argument. */
static int read_pointer(PyObject *const *args, int i, void **out) {
    if (args[i] == Py_None) {
        *out = NULL;
        return 0;
    }
    if (!PyLong_Check(args[i])) {
        PyErr_Format(PyExc_TypeError, "argument %d: expected an int address or None, got %s", i, Py_TYPE(args[i])->tp_name);
        return -1;
    }
    *out = PyLong_AsVoidPtr(args[i]);
    return PyErr_Occurred() ? -1 : 0;
}

static int read_i64(PyObject *const *args, int i, int64_t *out) {
    if (!PyLong_Check(args[i])) {
        PyErr_Format(PyExc_TypeError, "argument %d: expected an int, got %s", i, Py_TYPE(args[i])->tp_name);
        return -1;
    }
    long long value = PyLong_AsLongLong(args[i]);
    if (value == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)value;
    return 0;
}

static int read_int(PyObject *const *args, int i, int *out) {
    int64_t value;
    if (read_i64(args, i, &value)) return -1;
    if (value < INT_MIN || value > INT_MAX) {
        PyErr_Format(PyExc_OverflowError, "argument %d: %lld does not fit a C int", i, (long long)value);
        return -1;
    }
    *out = (int)value;
    return 0;
}

static int count_is(const char *name, Py_ssize_t given, Py_ssize_t expected) {
    if (given == expected) return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, expected, given);
    return -1;
}

/* hal_attention_prepare(dtype, page_size, q_heads, kv_heads, qk_dim, v_dim, block_table,
 * table_stride, kv_lens, cu_q_lens, batch, scaling, window, out_dtype, threads) -> address or None */
static PyObject *module_prepare(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (count_is("hal_attention_prepare", nargs, 15)) return NULL;
    int ints[6], batch, window, out_dtype, threads;
    void *block_table, *kv_lens, *cu_q_lens;
    int64_t table_stride;
    for (int i = 0; i < 6; i++)
        if (read_int(args, i, &ints[i])) return NULL;
    if (read_pointer(args, 6, &block_table) || read_i64(args, 7, &table_stride) || read_pointer(args, 8, &kv_lens)
        || read_pointer(args, 9, &cu_q_lens) || read_int(args, 10, &batch) || read_int(args, 12, &window)
        || read_int(args, 13, &out_dtype) || read_int(args, 14, &threads))
        return NULL;
    double scaling = PyFloat_AsDouble(args[11]);
    if (scaling == -1.0 && PyErr_Occurred()) return NULL;
    void *prepared = hal_attention_prepare(ints[0], ints[1], ints[2], ints[3], ints[4], ints[5], block_table, table_stride,
                                           kv_lens, cu_q_lens, batch, (float)scaling, window, out_dtype, threads);
    if (!prepared) Py_RETURN_NONE;
    return PyLong_FromVoidPtr(prepared);
}

/* hal_attention_run(prepared, q, q_stride_token, q_stride_head, out, k_cache, 3 k strides,
 * v_cache, 3 v strides, sinks, slots, n_slots, k_new, 2 k_new strides, v_new, 2 v_new strides) -> status */
static PyObject *module_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (count_is("hal_attention_run", nargs, 22)) return NULL;
    static const char pointer_at[22] = {1, 1, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 1, 0, 0, 1, 0, 0};
    void *pointers[22];
    int64_t values[22];
    int n_slots;
    for (int i = 0; i < 22; i++) {
        if (pointer_at[i] ? read_pointer(args, i, &pointers[i]) : read_i64(args, i, &values[i])) return NULL;
    }
    if (read_int(args, 15, &n_slots)) return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = hal_attention_run(pointers[0], pointers[1], values[2], values[3], pointers[4], pointers[5], values[6], values[7],
                               values[8], pointers[9], values[10], values[11], values[12], pointers[13], pointers[14],
                               n_slots, pointers[16], values[17], values[18], pointers[19], values[20], values[21]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(status);
}

static PyObject *module_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    void *prepared;
    if (count_is("hal_attention_release", nargs, 1) || read_pointer(args, 0, &prepared)) return NULL;
    hal_attention_release(prepared);
    Py_RETURN_NONE;
}

static PyObject *module_tiles(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self, (void)args;
    if (count_is("hal_paged_attention_tiles", nargs, 0)) return NULL;
    return PyLong_FromLong(hal_paged_attention_tiles());
}

static PyMethodDef module_methods[] = {
    {"hal_attention_prepare", (PyCFunction)(void (*)(void))module_prepare, METH_FASTCALL, "Prepare one kind of layer's call."},
    {"hal_attention_run", (PyCFunction)(void (*)(void))module_run, METH_FASTCALL, "Run a prepared call for one layer."},
    {"hal_attention_release", (PyCFunction)(void (*)(void))module_release, METH_FASTCALL, "Free a prepared call."},
    {"hal_paged_attention_tiles", (PyCFunction)(void (*)(void))module_tiles, METH_FASTCALL, "Query rows per prompt tile (0: none)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_definition = {
    PyModuleDef_HEAD_INIT, "_hal_paged_attention", "hal's compiled CPU paged attention (hal.backends.cpu.native).", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hal_paged_attention(void) { return PyModule_Create(&module_definition); }
