# Runs COMMAND (a ;-list) RUNS times, stopping at the first failure; for the stress tests, whose
# binaries take their randomised delays from the environment (RINGATTN_TEST_JITTER_US).
# Usage: cmake -DRUNS=<n> -DCOMMAND=<exe;args...> -P repeat.cmake
foreach(run RANGE 1 ${RUNS})
  execute_process(COMMAND ${COMMAND} RESULT_VARIABLE status OUTPUT_VARIABLE out
                  ERROR_VARIABLE out)
  if(NOT status EQUAL 0)
    message("${out}")
    message(FATAL_ERROR "run ${run} of ${RUNS} failed (exit ${status})")
  endif()
endforeach()
message(STATUS "${RUNS} runs passed")
