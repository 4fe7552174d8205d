#pragma once
//! \file
//! One concept per policy family of
//! `ring_attention<Partitioner, Communicator, BlockKernel, Schedule>`, each family's in its own
//! header under concepts/ (a layer that needs one family's concept includes only that one).
//! They state type-level requirements only; the facades re-check them with `static_assert` and a
//! sentence a user can act on.

#include <ringattn/concepts/block_kernel.cuh>
#include <ringattn/concepts/communicator.cuh>
#include <ringattn/concepts/partitioner.cuh>
#include <ringattn/concepts/schedule.cuh>
