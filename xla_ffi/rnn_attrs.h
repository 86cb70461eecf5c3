// The attribute dictionary every RNN handler decodes, and what follows from it.
//
// Python sends these as keyword attributes of `jax.ffi.ffi_call`
// (`_cudnn.Config.attrs()`); XLA decodes them by name into `RnnAttrs`. The
// decoding is registered here, once, for every handler including the CPU
// input check (`rnn_input_check.cc`) that lets CI prove the two sides agree.
#ifndef JAX_CUDNN_RNN_RNN_ATTRS_H_
#define JAX_CUDNN_RNN_RNN_ATTRS_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jcr {

struct RnnAttrs {
  int64_t cell_mode;    // cudnnRNNMode_t: 0 relu, 1 tanh, 2 lstm, 3 gru
  int64_t num_layers;
  int64_t hidden_size;
  int64_t input_size;
  bool bidirectional;
  bool skip_input;
  bool batch_major;     // x and y are [B, T, F] instead of [T, B, F]
  bool allow_tf32;      // float32 only: may cuDNN use TF32 tensor cores
  bool has_seq_lengths; // false: every sequence has T steps, no host sync
  int64_t algo;         // cudnnRNNAlgo_t asked for: 0 standard, 3 persist_static_small_h
};

// Output feature size: hidden_size times the number of directions.
inline int64_t OutputSize(const RnnAttrs& a) { return a.hidden_size * (a.bidirectional ? 2 : 1); }
// Initial/final state count: layers times directions.
inline int64_t NumStates(const RnnAttrs& a) { return a.num_layers * (a.bidirectional ? 2 : 1); }

}  // namespace jcr

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jcr::RnnAttrs, ::xla::ffi::StructMember<int64_t>("cell_mode"),
    ::xla::ffi::StructMember<int64_t>("num_layers"),
    ::xla::ffi::StructMember<int64_t>("hidden_size"),
    ::xla::ffi::StructMember<int64_t>("input_size"),
    ::xla::ffi::StructMember<bool>("bidirectional"),
    ::xla::ffi::StructMember<bool>("skip_input"),
    ::xla::ffi::StructMember<bool>("batch_major"),
    ::xla::ffi::StructMember<bool>("allow_tf32"),
    ::xla::ffi::StructMember<bool>("has_seq_lengths"),
    ::xla::ffi::StructMember<int64_t>("algo"));

#endif  // JAX_CUDNN_RNN_RNN_ATTRS_H_
