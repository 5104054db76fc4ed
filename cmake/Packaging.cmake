# Debian packages of libkvrouter, made by CPack from the install components of src/capi:
#
#   libkvrouter0.2   Runtime      libkvrouter.so.0.2 and .so.0.2.0 (section libs)
#   libkvrouter-dev  Development  headers, the libkvrouter.so namelink, kvrouter.pc and the CMake
#                                 package (section libdevel); depends on libkvrouter0.2 of the
#                                 same version
#
# Build them from a tree configured with -DCMAKE_INSTALL_PREFIX=/usr, so that GNUInstallDirs
# picks Debian's multiarch libdir (lib/x86_64-linux-gnu), then run `cpack` in it (README.md,
# "Installing"; scripts/test-packaging.sh). Every CPack and CPackDeb variable is set here, even
# where it is the default, so that no package field depends on a CPack fallback. Included last
# from the top-level CMakeLists.txt, after every install rule.

find_program(KVR_DPKG dpkg)
if(NOT KVR_DPKG)
  message(STATUS "kvrouter: no dpkg, so no Debian packaging (cpack) configured")
  return()
endif()
execute_process(COMMAND ${KVR_DPKG} --print-architecture OUTPUT_VARIABLE KVR_DEB_ARCH
                OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
find_program(KVR_DPKG_ARCHITECTURE dpkg-architecture)
if(KVR_DPKG_ARCHITECTURE)
  execute_process(COMMAND ${KVR_DPKG_ARCHITECTURE} -qDEB_HOST_MULTIARCH
                  OUTPUT_VARIABLE KVR_DEB_MULTIARCH OUTPUT_STRIP_TRAILING_WHITESPACE
                  COMMAND_ERROR_IS_FATAL ANY)
else()
  set(KVR_DEB_MULTIARCH "") # no dpkg-dev: cpack says so (cmake/CPackProjectConfig.cmake)
endif()

# The runtime package is named after the SONAME (libkvrouter.so.0.2 -> libkvrouter0.2).
set(KVR_DEB_RUNTIME_PACKAGE libkvrouter${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})

# What CPack itself needs.
set(CPACK_GENERATOR "DEB")
set(CPACK_PACKAGE_NAME "kvrouter")
set(CPACK_PACKAGE_VENDOR "kvrouter")
set(KVR_PACKAGE_MAINTAINER "kvrouter maintainers <kvrouter@users.noreply.github.com>"
    CACHE STRING "Maintainer field of the Debian packages")
set(CPACK_PACKAGE_CONTACT "${KVR_PACKAGE_MAINTAINER}")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "KV-cache-aware LLM request router (C ABI)")
set(CPACK_PACKAGE_HOMEPAGE_URL "https://github.com/kvrouter/kvrouter")
set(CPACK_PACKAGE_VERSION "${PROJECT_VERSION}")
set(CPACK_PACKAGE_VERSION_MAJOR "${PROJECT_VERSION_MAJOR}")
set(CPACK_PACKAGE_VERSION_MINOR "${PROJECT_VERSION_MINOR}")
set(CPACK_PACKAGE_VERSION_PATCH "${PROJECT_VERSION_PATCH}")
set(CPACK_PACKAGE_DIRECTORY "${PROJECT_BINARY_DIR}")
set(CPACK_PACKAGING_INSTALL_PREFIX "/usr")
set(CPACK_SET_DESTDIR OFF)
set(CPACK_STRIP_FILES ON)
set(CPACK_VERBATIM_VARIABLES ON)
set(CPACK_THREADS 1)
# Only the library's two components; the kvrouter CLI (tools/, component Unspecified) is not
# packaged.
set(CPACK_COMPONENTS_ALL Runtime Development)
set(CPACK_COMPONENTS_GROUPING IGNORE)
set(CPACK_DEB_COMPONENT_INSTALL ON)
# At cpack time: refuse a tree whose libdir is not /usr's multiarch one, and give each package
# its own synopsis.
set(CPACK_PROJECT_CONFIG_FILE "${CMAKE_CURRENT_LIST_DIR}/CPackProjectConfig.cmake")
set(CPACK_KVROUTER_INSTALL_PREFIX "${CMAKE_INSTALL_PREFIX}")
set(CPACK_KVROUTER_INSTALL_LIBDIR "${CMAKE_INSTALL_LIBDIR}")
set(CPACK_KVROUTER_DEB_MULTIARCH "${KVR_DEB_MULTIARCH}")
# Between installing into the staging directory and packaging: kvrouter.pc gets prefix=/usr.
set(CPACK_PRE_BUILD_SCRIPTS "${CMAKE_CURRENT_LIST_DIR}/CPackPreBuild.cmake")

# Fields shared by both packages.
set(CPACK_DEBIAN_PACKAGE_NAME "kvrouter") # base name only; each component has its own below
set(CPACK_DEBIAN_FILE_NAME "DEB-DEFAULT") # <package>_<version>-<release>_<arch>.deb
set(CPACK_DEBIAN_PACKAGE_EPOCH "")
set(CPACK_DEBIAN_PACKAGE_VERSION "${PROJECT_VERSION}")
set(CPACK_DEBIAN_PACKAGE_RELEASE "1")
set(CPACK_DEBIAN_PACKAGE_ARCHITECTURE "${KVR_DEB_ARCH}")
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${CPACK_PACKAGE_CONTACT}")
set(CPACK_DEBIAN_PACKAGE_HOMEPAGE "${CPACK_PACKAGE_HOMEPAGE_URL}")
set(CPACK_DEBIAN_PACKAGE_SOURCE "kvrouter")
set(CPACK_DEBIAN_PACKAGE_PRIORITY "optional")
set(CPACK_DEBIAN_PACKAGE_SECTION "libs")
set(CPACK_DEBIAN_PACKAGE_DESCRIPTION "${CPACK_PACKAGE_DESCRIPTION_SUMMARY}")
set(CPACK_DEBIAN_ARCHIVE_TYPE "gnutar")
set(CPACK_DEBIAN_COMPRESSION_TYPE "xz")
set(CPACK_DEBIAN_PACKAGE_DEPENDS "")
set(CPACK_DEBIAN_PACKAGE_PREDEPENDS "")
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "")
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "")
set(CPACK_DEBIAN_PACKAGE_ENHANCES "")
set(CPACK_DEBIAN_PACKAGE_BREAKS "")
set(CPACK_DEBIAN_PACKAGE_CONFLICTS "")
set(CPACK_DEBIAN_PACKAGE_PROVIDES "")
set(CPACK_DEBIAN_PACKAGE_REPLACES "")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA "")
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
# libkvrouter-dev depends on libkvrouter0.2 (= <this version>), from cpack_add_component below.
set(CPACK_DEBIAN_ENABLE_COMPONENT_DEPENDS ON)
# dpkg-shlibdeps (dpkg-dev) computes the runtime package's Depends from the library's NEEDED
# entries (libabsl*, libuv1, libzmq5, libnats3.x, libstdc++6, libc6); shlibs and the symbols file
# (below) let packages built against libkvrouter depend on it the same way. The two coexist, as
# debhelper's dh_makeshlibs makes them: dpkg-shlibdeps uses the symbols file when there is one
# and shlibs otherwise.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS "")
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS_POLICY ">=")
set(CPACK_DEBIAN_DEBUGINFO_PACKAGE OFF)
set(CPACK_DEBIAN_PACKAGE_DEBUG OFF)

# libkvrouter0.2: the shared library.
set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME "${KVR_DEB_RUNTIME_PACKAGE}")
set(CPACK_DEBIAN_RUNTIME_FILE_NAME "DEB-DEFAULT")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_ARCHITECTURE "${KVR_DEB_ARCH}")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SECTION "libs")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_PRIORITY "optional")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SOURCE "kvrouter")
set(CPACK_DEBIAN_RUNTIME_DESCRIPTION
    "KV-cache-aware LLM request router (shared library)
kvrouter answers, for a prompt's token ids, which worker of an LLM serving fleet
will serve it fastest: the one holding the longest prefix of the prompt in its KV
cache, weighed against how loaded each worker is. It follows the semantics of
NVIDIA Dynamo's router and ingests live KV events from vLLM, SGLang, NATS and its
own FlatBuffers stream.
.
This package contains the shared library, which exports only the kvr_* C ABI.")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_DEPENDS "") # all from dpkg-shlibdeps
set(CPACK_DEBIAN_RUNTIME_PACKAGE_PREDEPENDS "")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_RECOMMENDS "")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SUGGESTS "")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_ENHANCES "")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_BREAKS "")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_CONFLICTS "")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_PROVIDES "")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_REPLACES "")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SHLIBDEPS ON)
# ldconfig as a dpkg trigger (cmake/debian/triggers), as debhelper does. CPack 3.25 also writes
# a postinst and a postrm that call ldconfig for any library under /usr/lib, and cannot be told
# not to short of shipping our own scripts: redundant with the trigger, and harmless.
set(CPACK_DEBIAN_RUNTIME_PACKAGE_CONTROL_EXTRA "${CMAKE_CURRENT_LIST_DIR}/debian/triggers")
# The symbols file (deb-symbols(5)): cmake/debian/<runtime package>.symbols lists every exported
# symbol with its version node (KVR_<major.minor>, src/capi/kvrouter.map) and the release that
# introduced it, so that a package built against libkvrouter depends on the release that has
# every symbol it uses. CPack names a control file after its file name, so it is copied to
# debian/symbols in the build tree. scripts/test-packaging.sh checks it against the library with
# dpkg-gensymbols; scripts/abi-baseline.sh records new symbols in it, and writes the file of a
# new runtime package after a SONAME bump.
set(KVR_DEB_SYMBOLS "${CMAKE_CURRENT_LIST_DIR}/debian/${KVR_DEB_RUNTIME_PACKAGE}.symbols")
if(EXISTS "${KVR_DEB_SYMBOLS}")
  configure_file("${KVR_DEB_SYMBOLS}" "${PROJECT_BINARY_DIR}/debian/symbols" COPYONLY)
  list(APPEND CPACK_DEBIAN_RUNTIME_PACKAGE_CONTROL_EXTRA "${PROJECT_BINARY_DIR}/debian/symbols")
else()
  file(REMOVE "${PROJECT_BINARY_DIR}/debian/symbols")
  message(WARNING "kvrouter: no ${KVR_DEB_SYMBOLS}, so ${KVR_DEB_RUNTIME_PACKAGE} gets no symbols "
                  "file; scripts/abi-baseline.sh writes it")
endif()
set(CPACK_DEBIAN_RUNTIME_PACKAGE_CONTROL_STRICT_PERMISSION ON)
set(CPACK_DEBIAN_RUNTIME_DEBUGINFO_PACKAGE OFF)

# libkvrouter-dev: everything needed to build against the library.
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_NAME "libkvrouter-dev")
set(CPACK_DEBIAN_DEVELOPMENT_FILE_NAME "DEB-DEFAULT")
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_ARCHITECTURE "${KVR_DEB_ARCH}")
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_SECTION "libdevel")
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_PRIORITY "optional")
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_SOURCE "kvrouter")
set(CPACK_DEBIAN_DEVELOPMENT_DESCRIPTION
    "KV-cache-aware LLM request router (development files)
kvrouter answers, for a prompt's token ids, which worker of an LLM serving fleet
will serve it fastest: the one holding the longest prefix of the prompt in its KV
cache, weighed against how loaded each worker is.
.
This package contains the C headers (kvrouter.h, kvrouter_version.h), the
libkvrouter.so link, the pkg-config file (kvrouter) and the CMake package
(kvrouter::kvrouter).")
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_DEPENDS "") # the runtime package, added by CPack
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_PREDEPENDS "")
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_RECOMMENDS "pkg-config")
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_SUGGESTS "cmake")
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_ENHANCES "")
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_BREAKS "")
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_CONFLICTS "")
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_PROVIDES "")
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_REPLACES "")
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_SHLIBDEPS OFF) # no ELF file in it
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_CONTROL_EXTRA "")
set(CPACK_DEBIAN_DEVELOPMENT_PACKAGE_CONTROL_STRICT_PERMISSION ON)
set(CPACK_DEBIAN_DEVELOPMENT_DEBUGINFO_PACKAGE OFF)

include(CPack)
cpack_add_component(Runtime DISPLAY_NAME "kvrouter shared library"
                    DESCRIPTION "libkvrouter.so.${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR}")
cpack_add_component(Development DISPLAY_NAME "kvrouter development files"
                    DESCRIPTION "Headers, pkg-config file and CMake package" DEPENDS Runtime)
