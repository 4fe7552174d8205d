#pragma once
//! \file
//! The cuDNN block kernel: `ringattn::cudnn_kernel<Mask, T>` (cudnn/block_kernel.cuh), a third
//! template argument of `ring_attention` that computes every ring step's block with cuDNN's fused
//! attention. Link `ringattn::cudnn` (cuDNN 9 and the cudnn-frontend headers); everything else
//! comes from `<ringattn/ringattn.cuh>`.
//!
//! \code
//! #include <ringattn/ringattn.cuh>
//! #include <ringattn/cudnn.cuh>
//! using attention = ringattn::ring_attention<ringattn::zigzag, ringattn::nccl_communicator,
//!                                            ringattn::cudnn_causal>;  // bf16
//! \endcode

#include <ringattn/cudnn/block_kernel.cuh>
