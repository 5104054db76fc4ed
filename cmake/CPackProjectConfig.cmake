# Read by cpack itself (CPACK_PROJECT_CONFIG_FILE, set in cmake/Packaging.cmake), once per
# generator, just before it builds the packages.
if(CPACK_GENERATOR STREQUAL "DEB")
  # The install rules put the library in ${CMAKE_INSTALL_LIBDIR}, which CPack places under /usr,
  # so that libdir must be Debian's multiarch one. GNUInstallDirs chooses it only when the tree
  # is configured with CMAKE_INSTALL_PREFIX=/usr.
  if(NOT CPACK_KVROUTER_DEB_MULTIARCH)
    message(FATAL_ERROR "kvrouter: dpkg-architecture (package dpkg-dev) was not found when this "
                        "tree was configured; install dpkg-dev and configure again")
  endif()
  if(NOT CPACK_KVROUTER_INSTALL_LIBDIR STREQUAL "lib/${CPACK_KVROUTER_DEB_MULTIARCH}")
    message(FATAL_ERROR "kvrouter: this tree installs libraries into "
                        "'${CPACK_KVROUTER_INSTALL_PREFIX}/${CPACK_KVROUTER_INSTALL_LIBDIR}'; "
                        "Debian packages need /usr/lib/${CPACK_KVROUTER_DEB_MULTIARCH}. Configure "
                        "a fresh build directory with -DCMAKE_INSTALL_PREFIX=/usr and run cpack "
                        "there.")
  endif()
  # Each package's synopsis is the first line of its CPACK_DEBIAN_<COMPONENT>_DESCRIPTION:
  # CPackDeb would otherwise put the one project-wide summary on top of both.
  unset(CPACK_PACKAGE_DESCRIPTION_SUMMARY)
endif()
