# The API reference from the headers' //! comments: `cmake --build <dir> --target docs` writes
# <dir>/docs/html. With tests, `docs.reference` builds it and fails on any Doxygen warning.
find_package(Doxygen QUIET)
if(NOT DOXYGEN_FOUND)
  message(STATUS "ringattn: Doxygen not found; the docs target is not provided")
  return()
endif()
set(RINGATTN_DOCS_OUTPUT "${PROJECT_BINARY_DIR}/docs")
configure_file("${PROJECT_SOURCE_DIR}/docs/Doxyfile.in" "${PROJECT_BINARY_DIR}/Doxyfile" @ONLY)
add_custom_target(docs
  COMMAND ${DOXYGEN_EXECUTABLE} "${PROJECT_BINARY_DIR}/Doxyfile"
  WORKING_DIRECTORY "${PROJECT_SOURCE_DIR}"
  COMMENT "ringattn: the API reference (Doxygen) into ${RINGATTN_DOCS_OUTPUT}/html"
  VERBATIM)
if(RINGATTN_BUILD_TESTS)
  add_test(NAME docs.reference COMMAND ${DOXYGEN_EXECUTABLE} "${PROJECT_BINARY_DIR}/Doxyfile"
    WORKING_DIRECTORY "${PROJECT_SOURCE_DIR}")
  # Doxygen exits non-zero on a warning (WARN_AS_ERROR); any output at all is a warning too.
  set_tests_properties(docs.reference PROPERTIES LABELS docs FAIL_REGULAR_EXPRESSION "warning|error")
endif()
