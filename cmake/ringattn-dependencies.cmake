# CCCL (Thrust, CUB, libcu++) from the CUDA toolkit. Used by the project and by the installed
# package config, so a consumer finds the same CCCL the library was written against.
if(NOT TARGET CCCL::CCCL)
  find_package(CCCL CONFIG QUIET
    HINTS "${CUDAToolkit_LIBRARY_DIR}/cmake" "${CUDAToolkit_LIBRARY_ROOT}/lib64/cmake")
  if(NOT CCCL_FOUND)
    # Older toolkits ship CCCL headers without a package: point at the headers ourselves.
    find_path(RINGATTN_CCCL_INCLUDE_DIR cub/cub.cuh
      HINTS ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES cccl REQUIRED)
    add_library(CCCL::CCCL INTERFACE IMPORTED)
    target_include_directories(CCCL::CCCL INTERFACE "${RINGATTN_CCCL_INCLUDE_DIR}")
  endif()
endif()
