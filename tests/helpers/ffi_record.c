/* A tvm-ffi module for tests/test_ffi.py: `main` records every argument as it received it (the DLTensor
   fields, scalar bits) into the int64 tensor `rec` (its third argument) and, given
   (x, y, rec, k, a, flag) with float32 x and y (as many elements), writes y = x * a + (flag ? k : 0);
   `twice` writes y = 2 * x; `stream` records the env stream. All accept a tensor as a DLTensor* or a tensor object, as
   TileLang's host code does. */
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <stdint.h>
#include <string.h>

/* As TileLang's host code: a DLTensor* or a tensor object (its DLTensor after the 24-byte header). */
static DLTensor* tensor_of(const TVMFFIAny* a) {
  if (a->type_index == kTVMFFITensor) return (DLTensor*)((char*)a->v_obj + sizeof(TVMFFIObject));
  return a->type_index == kTVMFFIDLTensorPtr ? (DLTensor*)a->v_ptr : NULL;
}

TVM_FFI_DLL_EXPORT int __tvm_ffi_main(void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result) {
  if (num_args < 3) { TVMFFIErrorSetRaisedFromCStr("ValueError", "too few args"); return -1; }
  if (!tensor_of(&args[2])) { TVMFFIErrorSetRaisedFromCStr("TypeError", "rec must be a tensor"); return -1; }
  int64_t* rec = (int64_t*)tensor_of(&args[2])->data;
  int64_t n = 0;
  rec[n++] = num_args;
  rec[n++] = result->type_index;
  for (int i = 0; i < num_args; ++i) {
    rec[n++] = args[i].type_index == kTVMFFITensor ? kTVMFFIDLTensorPtr : args[i].type_index;
    rec[n++] = args[i].zero_padding;
    DLTensor* t = tensor_of(&args[i]);
    if (t) {
      rec[n++] = (int64_t)(intptr_t)t->data;
      rec[n++] = t->device.device_type; rec[n++] = t->device.device_id;
      rec[n++] = t->ndim; rec[n++] = t->dtype.code; rec[n++] = t->dtype.bits; rec[n++] = t->dtype.lanes;
      rec[n++] = (int64_t)t->byte_offset;
      for (int d = 0; d < t->ndim; ++d) rec[n++] = t->shape[d];
      for (int d = 0; d < t->ndim; ++d) rec[n++] = t->strides ? t->strides[d] : -1;
    } else {
      rec[n++] = args[i].v_int64;
    }
  }
  DLTensor* x = tensor_of(&args[0]); DLTensor* y = tensor_of(&args[1]);
  if (num_args == 6 && x && y && x->dtype.code == kDLFloat && x->dtype.bits == 32 && y->dtype.code == kDLFloat &&
      y->dtype.bits == 32) {
    int64_t numel = 1; for (int d = 0; d < x->ndim; ++d) numel *= x->shape[d];
    double a = args[4].type_index == kTVMFFIFloat ? args[4].v_float64 : (double)args[4].v_int64;
    int64_t k = args[3].v_int64;
    if (k < 0) { TVMFFIErrorSetRaisedFromCStr("RuntimeError", "kernel main: k must be >= 0"); return -1; }
    for (int64_t i = 0; i < numel; ++i)
      ((float*)y->data)[i] = ((float*)x->data)[i] * (float)a + (args[5].v_int64 ? (float)k : 0.0f);
  }
  return 0;
}

TVM_FFI_DLL_EXPORT int __tvm_ffi_twice(void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result) {
  DLTensor* x = num_args == 2 ? tensor_of(&args[0]) : NULL;
  DLTensor* y = num_args == 2 ? tensor_of(&args[1]) : NULL;
  if (!x || !y || x->dtype.code != kDLFloat || x->dtype.bits != 32) {
    TVMFFIErrorSetRaisedFromCStr("TypeError", "twice takes two float32 tensors");
    return -1;
  }
  int64_t numel = 1;
  for (int d = 0; d < x->ndim; ++d) numel *= x->shape[d];
  for (int64_t i = 0; i < numel; ++i) ((float*)y->data)[i] = 2.0f * ((float*)x->data)[i];
  return 0;
}

/* stream(rec): rec[0] = the env stream of rec's device during the call (what a CUDA kernel launches on). */
TVM_FFI_DLL_EXPORT int __tvm_ffi_stream(void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result) {
  DLTensor* rec = num_args == 1 ? tensor_of(&args[0]) : NULL;
  if (!rec) { TVMFFIErrorSetRaisedFromCStr("TypeError", "stream takes one tensor"); return -1; }
  ((int64_t*)rec->data)[0] = (int64_t)(intptr_t)TVMFFIEnvGetStream(rec->device.device_type, rec->device.device_id);
  return 0;
}
