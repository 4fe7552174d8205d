# Install rules, the package config (with components nccl, mpi and cudnn), its version file and a
# build-tree export, so find_package(ringattn) works against an install prefix or a build tree.
include(CMakePackageConfigHelpers)
set(RINGATTN_CONFIG_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/ringattn")

configure_package_config_file(cmake/ringattn-config.cmake.in
  "${PROJECT_BINARY_DIR}/ringattn-config.cmake" INSTALL_DESTINATION "${RINGATTN_CONFIG_DIR}")
# A header-only library has no ABI to match across 0.x minors: same major and minor only.
write_basic_package_version_file("${PROJECT_BINARY_DIR}/ringattn-config-version.cmake"
  COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)

# One export set per component so the core targets never reference NCCL or MPI.
export(TARGETS ringattn NAMESPACE ringattn:: FILE "${PROJECT_BINARY_DIR}/ringattn-targets.cmake")
foreach(c IN LISTS RINGATTN_COMPONENTS)
  export(TARGETS ringattn_${c} NAMESPACE ringattn:: FILE "${PROJECT_BINARY_DIR}/ringattn-${c}-targets.cmake")
endforeach()
file(COPY cmake/FindNCCL.cmake cmake/FindCUDNN.cmake cmake/ringattn-dependencies.cmake
  DESTINATION "${PROJECT_BINARY_DIR}")

if(RINGATTN_INSTALL)
  install(DIRECTORY include/ DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
  install(TARGETS ringattn EXPORT ringattn-targets)
  install(EXPORT ringattn-targets NAMESPACE ringattn:: DESTINATION "${RINGATTN_CONFIG_DIR}")
  foreach(c IN LISTS RINGATTN_COMPONENTS)
    install(TARGETS ringattn_${c} EXPORT ringattn-${c}-targets)
    install(EXPORT ringattn-${c}-targets NAMESPACE ringattn:: DESTINATION "${RINGATTN_CONFIG_DIR}")
  endforeach()
  install(FILES
    "${PROJECT_BINARY_DIR}/ringattn-config.cmake"
    "${PROJECT_BINARY_DIR}/ringattn-config-version.cmake"
    cmake/FindNCCL.cmake cmake/FindCUDNN.cmake cmake/ringattn-dependencies.cmake
    DESTINATION "${RINGATTN_CONFIG_DIR}")
  install(FILES LICENSE README.md DESTINATION "${CMAKE_INSTALL_DATADIR}/doc/ringattn")
endif()
