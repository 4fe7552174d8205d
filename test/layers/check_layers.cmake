# The include layers of include/ringattn: every header belongs to one layer, and includes only
# headers of its own layer or of lower ones. Folders of one rank never include each other, so no
# two folders include each other both ways. Device code (core/, device/) stays below every
# host-side header. Run: cmake -DROOT=<source dir> -P check_layers.cmake
#
#   0 base        config.cuh, version.cuh
#   1 core/       plain types and math for host and device
#   2 device/     kernels and device primitives
#   3 foundation  error.cuh, arguments.cuh, tensor.cuh, cuda_check.cuh, detail/
#   4 kernel/     host-side launchers, schedules, host block kernels
#   5 concepts.cuh
#   6 partition/, reference/, comm/
#   7 block_kernel.cuh
#   8 ring/, cudnn/ (the cuDNN block kernel)
#   9 ring_attention.cuh, sharded_attention.cuh
#  10 ringattn.cuh, cudnn.cuh
cmake_minimum_required(VERSION 3.25)
if(NOT ROOT)
  message(FATAL_ERROR "check_layers.cmake: pass -DROOT=<source dir>")
endif()

function(layer_of path out_rank out_group)
  if(path MATCHES "^(config|version)\\.cuh$")
    set(r 0)
    set(g base)
  elseif(path MATCHES "^core/")
    set(r 1)
    set(g core)
  elseif(path MATCHES "^device/")
    set(r 2)
    set(g device)
  elseif(path MATCHES "^(error|arguments|tensor|cuda_check)\\.cuh$" OR path MATCHES "^detail/")
    set(r 3)
    set(g foundation)
  elseif(path MATCHES "^kernel/")
    set(r 4)
    set(g kernel)
  elseif(path STREQUAL "concepts.cuh")
    set(r 5)
    set(g concepts)
  elseif(path MATCHES "^(partition|reference|comm)/")
    string(REGEX REPLACE "/.*" "" g "${path}")
    set(r 6)
  elseif(path STREQUAL "block_kernel.cuh")
    set(r 7)
    set(g block_kernel)
  elseif(path MATCHES "^(ring|cudnn)/")
    string(REGEX REPLACE "/.*" "" g "${path}")
    set(r 8)
  elseif(path STREQUAL "ring_attention.cuh" OR path STREQUAL "sharded_attention.cuh")
    set(r 9)
    string(REGEX REPLACE "\\.cuh$" "" g "${path}")
  elseif(path STREQUAL "ringattn.cuh" OR path STREQUAL "cudnn.cuh")
    set(r 10)
    string(REGEX REPLACE "\\.cuh$" "" g "${path}")
  else()
    set(r -1)
    set(g none)
  endif()
  set(${out_rank} ${r} PARENT_SCOPE)
  set(${out_group} ${g} PARENT_SCOPE)
endfunction()

file(GLOB_RECURSE headers RELATIVE "${ROOT}/include/ringattn" "${ROOT}/include/ringattn/*.cuh")
set(failures 0)
foreach(h IN LISTS headers)
  layer_of("${h}" rank group)
  if(rank LESS 0)
    message(SEND_ERROR "${h}: in no layer (add it to test/layers/check_layers.cmake)")
    math(EXPR failures "${failures} + 1")
    continue()
  endif()
  file(STRINGS "${ROOT}/include/ringattn/${h}" lines REGEX "^#include <ringattn/")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "^#include <ringattn/([^>]*)>.*" "\\1" target "${line}")
    layer_of("${target}" trank tgroup)
    if(trank LESS 0)
      message(SEND_ERROR "${h} includes ${target}, which is in no layer")
      math(EXPR failures "${failures} + 1")
    elseif(NOT tgroup STREQUAL group AND NOT trank LESS rank)
      message(SEND_ERROR "${h} (layer ${rank}, ${group}) includes ${target} (layer ${trank}, "
                         "${tgroup}): a layer includes only lower layers")
      math(EXPR failures "${failures} + 1")
    endif()
  endforeach()
endforeach()
list(LENGTH headers count)
if(failures GREATER 0)
  message(FATAL_ERROR "${failures} include(s) break the layers")
endif()
message(STATUS "include layers: ${count} headers, every include points down")
