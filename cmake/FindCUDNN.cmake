# FindCUDNN
# ---------
# Finds cuDNN 9 (header cudnn.h, library libcudnn) and the cudnn-frontend C++ headers
# (cudnn_frontend.h). Searched, in order: CUDNN_ROOT / CUDNN_FRONTEND_ROOT (CMake or environment
# variables), the CUDA toolkit's folders (CUDA 13 ships cuDNN there), CUDA_HOME, the system
# paths. cudnn-frontend's headers come from its own install, a checkout's include/, or the
# `nvidia-cudnn-frontend` Python wheel's include/ (pass its site-packages folder as
# CUDNN_FRONTEND_ROOT).
#
# Result: CUDNN_FOUND, CUDNN_INCLUDE_DIR, CUDNN_LIBRARY, CUDNN_VERSION, CUDNN_FRONTEND_INCLUDE_DIR,
# CUDNN_FRONTEND_VERSION and the imported targets CUDNN::cudnn and CUDNN::frontend (the headers,
# linked to CUDNN::cudnn).
if(NOT CUDAToolkit_FOUND)
  find_package(CUDAToolkit QUIET)
endif()
set(_cudnn_hints ${CUDNN_ROOT} $ENV{CUDNN_ROOT} ${CUDAToolkit_LIBRARY_ROOT} $ENV{CUDA_HOME})
find_path(CUDNN_INCLUDE_DIR cudnn_version.h
  HINTS ${_cudnn_hints} ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
find_library(CUDNN_LIBRARY NAMES cudnn libcudnn.so.9 NAMES_PER_DIR
  HINTS ${_cudnn_hints} ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu)
find_path(CUDNN_FRONTEND_INCLUDE_DIR cudnn_frontend.h
  HINTS ${CUDNN_FRONTEND_ROOT} $ENV{CUDNN_FRONTEND_ROOT} ${_cudnn_hints} PATH_SUFFIXES include)

if(CUDNN_INCLUDE_DIR AND EXISTS "${CUDNN_INCLUDE_DIR}/cudnn_version.h")
  file(STRINGS "${CUDNN_INCLUDE_DIR}/cudnn_version.h" _v REGEX "^#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) +[0-9]+")
  string(REGEX REPLACE ".*CUDNN_MAJOR +([0-9]+).*" "\\1" _maj "${_v}")
  string(REGEX REPLACE ".*CUDNN_MINOR +([0-9]+).*" "\\1" _min "${_v}")
  string(REGEX REPLACE ".*CUDNN_PATCHLEVEL +([0-9]+).*" "\\1" _pat "${_v}")
  set(CUDNN_VERSION "${_maj}.${_min}.${_pat}")
endif()
if(CUDNN_FRONTEND_INCLUDE_DIR AND EXISTS "${CUDNN_FRONTEND_INCLUDE_DIR}/cudnn_frontend_version.h")
  file(STRINGS "${CUDNN_FRONTEND_INCLUDE_DIR}/cudnn_frontend_version.h" _v
    REGEX "^#define CUDNN_FRONTEND_(MAJOR|MINOR|PATCH)_VERSION +[0-9]+")
  string(REGEX REPLACE ".*CUDNN_FRONTEND_MAJOR_VERSION +([0-9]+).*" "\\1" _maj "${_v}")
  string(REGEX REPLACE ".*CUDNN_FRONTEND_MINOR_VERSION +([0-9]+).*" "\\1" _min "${_v}")
  string(REGEX REPLACE ".*CUDNN_FRONTEND_PATCH_VERSION +([0-9]+).*" "\\1" _pat "${_v}")
  set(CUDNN_FRONTEND_VERSION "${_maj}.${_min}.${_pat}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(CUDNN
  REQUIRED_VARS CUDNN_LIBRARY CUDNN_INCLUDE_DIR CUDNN_FRONTEND_INCLUDE_DIR VERSION_VAR CUDNN_VERSION)
if(CUDNN_FOUND AND CUDNN_VERSION VERSION_LESS 9.0)
  set(CUDNN_FOUND FALSE)
  message(STATUS "cuDNN ${CUDNN_VERSION} at ${CUDNN_INCLUDE_DIR} is older than 9.0")
endif()
if(CUDNN_FOUND AND NOT TARGET CUDNN::cudnn)
  add_library(CUDNN::cudnn UNKNOWN IMPORTED)
  set_target_properties(CUDNN::cudnn PROPERTIES
    IMPORTED_LOCATION "${CUDNN_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${CUDNN_INCLUDE_DIR}")
  add_library(CUDNN::frontend INTERFACE IMPORTED)
  target_include_directories(CUDNN::frontend SYSTEM INTERFACE "${CUDNN_FRONTEND_INCLUDE_DIR}")
  # The frontend's JSON serialization costs minutes of nvcc time per translation unit; nothing
  # here serializes graphs.
  target_compile_definitions(CUDNN::frontend INTERFACE CUDNN_FRONTEND_SKIP_JSON_LIB)
  # The frontend's own engines compile kernels at run time (NVRTC).
  target_link_libraries(CUDNN::frontend INTERFACE CUDNN::cudnn CUDA::nvrtc)
endif()
mark_as_advanced(CUDNN_INCLUDE_DIR CUDNN_LIBRARY CUDNN_FRONTEND_INCLUDE_DIR)
