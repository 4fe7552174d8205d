# The install route a user without test tools takes: `cmake --preset install`, then
# `cmake --install`, with MPI, doctest and Google Benchmark made unfindable; then a consumer built
# with find_package against that prefix. Run by CTest (packaging.install_preset).
# Usage: cmake -DSOURCE=<ringattn> -DWORK=<dir> -DCONSUMER=<consumer project> -DGENERATOR=<g>
#              -DCUDA_ARCHITECTURES=<a> -P install_preset.cmake
file(REMOVE_RECURSE "${WORK}")
function(run what)
  execute_process(COMMAND ${ARGN} WORKING_DIRECTORY "${SOURCE}" RESULT_VARIABLE status
                  OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "${what} failed (exit ${status}):\n${out}")
  endif()
  set(output "${out}" PARENT_SCOPE)
endfunction()
run("cmake --preset install" ${CMAKE_COMMAND} --preset install -B "${WORK}/build"
    -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON -DCMAKE_DISABLE_FIND_PACKAGE_doctest=ON
    -DCMAKE_DISABLE_FIND_PACKAGE_benchmark=ON)
run("cmake --install" ${CMAKE_COMMAND} --install "${WORK}/build" --prefix "${WORK}/prefix")
foreach(f lib/cmake/ringattn/ringattn-config.cmake include/ringattn/ringattn.cuh
          share/doc/ringattn/LICENSE)
  if(NOT EXISTS "${WORK}/prefix/${f}")
    message(FATAL_ERROR "the install has no ${f}")
  endif()
endforeach()
if(EXISTS "${WORK}/prefix/lib/cmake/ringattn/ringattn-mpi-targets.cmake")
  message(FATAL_ERROR "MPI was hidden, yet the install exports ringattn::mpi")
endif()
run("the consumer" ${CMAKE_CTEST_COMMAND} --build-and-test "${CONSUMER}" "${WORK}/consumer"
    --build-generator "${GENERATOR}"
    --build-options "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES}" -DCMAKE_BUILD_TYPE=Release
      -DRINGATTN_CONSUME=find_package "-DCMAKE_PREFIX_PATH=${WORK}/prefix"
    --test-command consumer)
message("${output}")
