# cmake -DCOMMAND=<compiler;args...> -DEXPECT=<regex> -P expect_error.cmake
# Passes when COMMAND fails and the first line of its output with "error:" matches
# EXPECT: a misuse stops the compiler with the library's sentence before any other error.
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc EQUAL 0)
  message(FATAL_ERROR "compiled, but the library should have refused it:\n${out}")
endif()
string(REGEX MATCH "[^\n]*error:[^\n]*" first "${out}")
if(NOT first MATCHES "${EXPECT}")
  message(FATAL_ERROR "the first error is not the sentence \"${EXPECT}\":\n${out}")
endif()
message(STATUS "refused with: ${first}")
