# Run by cpack (CPACK_PRE_BUILD_SCRIPTS, set in cmake/Packaging.cmake) once the components are
# installed into its staging directory, before the packages are made.
#
# An installed kvrouter.pc finds its prefix from its own location (${pcfiledir}/../../..), right
# wherever a tree is installed. But pkg-config drops the system directories from its output only
# when they are spelled out, so from /usr it would hand every consumer
# -I/usr/lib/<multiarch>/pkgconfig/../../../include and -L/usr/lib/<multiarch>/pkgconfig/../../..
# /lib/<multiarch>. A Debian package always lands in /usr: its kvrouter.pc says prefix=/usr.
if(CPACK_GENERATOR STREQUAL "DEB")
  file(GLOB_RECURSE kvr_pc_files "${CPACK_TEMPORARY_DIRECTORY}/*/kvrouter.pc")
  if(NOT kvr_pc_files)
    message(FATAL_ERROR "kvrouter: no kvrouter.pc under ${CPACK_TEMPORARY_DIRECTORY}")
  endif()
  foreach(kvr_pc IN LISTS kvr_pc_files)
    file(READ "${kvr_pc}" kvr_pc_text)
    string(REGEX REPLACE "(^|\n)prefix=[^\n]*" "\\1prefix=${CPACK_PACKAGING_INSTALL_PREFIX}"
           kvr_pc_text "${kvr_pc_text}")
    file(WRITE "${kvr_pc}" "${kvr_pc_text}")
  endforeach()
endif()
