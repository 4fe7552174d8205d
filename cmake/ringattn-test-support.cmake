# Helpers for ringattn's own tests.

# doctest: the package config where the system has one (Debian's doctest-dev), else the header.
if(NOT TARGET ringattn_doctest)
  find_package(doctest CONFIG QUIET)
  add_library(ringattn_doctest INTERFACE)
  if(TARGET doctest::doctest)
    target_link_libraries(ringattn_doctest INTERFACE doctest::doctest)
  else()
    find_path(RINGATTN_DOCTEST_INCLUDE_DIR doctest/doctest.h
      PATHS /usr/include /usr/local/include
      DOC "directory holding doctest/doctest.h" REQUIRED)
    target_include_directories(ringattn_doctest SYSTEM INTERFACE "${RINGATTN_DOCTEST_INCLUDE_DIR}")
  endif()
endif()
find_package(Threads REQUIRED)

# mpirun as root (CI and the device machine run as root) and on fewer cores than ranks. Under
# AddressSanitizer (the asan preset) MPI processes run without leak detection: Open MPI keeps
# memory until exit by design, in libraries whose frames LeakSanitizer cannot name; memory errors
# and undefined behaviour are still caught. (The variable means nothing to other builds.)
set(RINGATTN_MPI_ENV "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1;ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=0:halt_on_error=1")
set(RINGATTN_MPIEXEC_FLAGS "")

# Warnings are errors in the project's own targets (RINGATTN_WERROR, on by default; a machine with
# a newer compiler may turn it off to see new warnings without failing the build).
option(RINGATTN_WERROR "Treat warnings in ringattn's tests and examples as errors" ON)
function(ringattn_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>)
    if(RINGATTN_WERROR)
      target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
    endif()
  endif()
  if(CMAKE_CUDA_COMPILER)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
    if(RINGATTN_WERROR)
      target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings>)
    endif()
  endif()
endfunction()

# ringattn_test_executable(<target> [FULL]): an executable that tests run joins
# ringattn_fast_tests, unless FULL (the full tier alone builds it, and its tests carry the label
# full).
function(ringattn_test_executable target)
  if(TARGET ringattn_fast_tests AND NOT "FULL" IN_LIST ARGN)
    add_dependencies(ringattn_fast_tests ${target})
  endif()
endfunction()

# ringattn_add_doctest_suite(<label> [FULL] MAIN <main> SOURCES <files...>
#                            [SUPPORT <files...>] LIBRARIES <libs...>)
# One executable per label; one CTest test per source file (doctest --source-file filter), named
# <label>.<file stem>; SUPPORT files (helpers without test cases) are compiled in, not registered.
# GPU suites (gpu, multigpu) map exit code 77 to "Skipped".
function(ringattn_add_doctest_suite label)
  cmake_parse_arguments(arg "FULL" "MAIN" "SOURCES;SUPPORT;LIBRARIES" ${ARGN})
  set(exe ringattn_test_${label})
  add_executable(${exe} ${arg_MAIN} ${arg_SOURCES} ${arg_SUPPORT})
  target_link_libraries(${exe} PRIVATE ${arg_LIBRARIES} ringattn_doctest Threads::Threads)
  ringattn_warnings(${exe})
  if(arg_FULL)
    ringattn_test_executable(${exe} FULL)
  else()
    ringattn_test_executable(${exe})
  endif()
  foreach(src IN LISTS arg_SOURCES)
    get_filename_component(stem ${src} NAME_WE)
    get_filename_component(name ${src} NAME)
    add_test(NAME ${label}.${stem} COMMAND ${exe} --source-file=*${name} --no-intro=true)
    set_tests_properties(${label}.${stem} PROPERTIES LABELS ${label} TIMEOUT 600)
    if(label STREQUAL "gpu")
      set_tests_properties(${label}.${stem} PROPERTIES SKIP_RETURN_CODE 77 RESOURCE_LOCK gpu)
    elseif(label STREQUAL "multigpu") # also under -L gpu; skipped with fewer than two GPUs
      set_tests_properties(${label}.${stem} PROPERTIES LABELS "gpu;multigpu"
        SKIP_RETURN_CODE 77 RESOURCE_LOCK gpu TIMEOUT 300)
    endif()
    if(arg_FULL)
      set_property(TEST ${label}.${stem} APPEND PROPERTY LABELS full)
    endif()
  endforeach()
endfunction()
