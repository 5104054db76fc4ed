# Run as a script (cmake -P) after the glue is built: makes the jar's native self-contained the way
# auditwheel makes a wheel, without any run path. It walks the glue's NEEDED graph (readelf -d, the
# libraries resolved as the dynamic linker resolves them: ldd), copies every library of it that is
# not kept on the system (SYSTEM_REGEX: glibc's and, unless asked otherwise, the C++ runtime) next
# to the glue under its soname, and writes
#   OUT_DIR/INDEX                          the copied libraries in load order: each one after
#                                          every library it needs (a topological order);
#   NOTICE_FILE                            per copied file: its Debian package, version, source
#                                          package and the licences its copyright file names;
#   LICENSE_DIR/<package>.copyright        that copyright file, whole.
# io.kvrouter.NativeLoader extracts them with the glue into one directory and System.load()s them
# in the index's order, then the glue: the dynamic linker satisfies a NEEDED entry with a library
# already loaded under that soname, so no run path and no LD_LIBRARY_PATH is involved.
# MODE=none removes what an earlier run left (the index, the files it lists, the notices): a glue
# linked with libkvrouter.so (KVRJ_LINK=shared) or KVRJ_VENDOR=OFF takes everything from the system.
#
# -D variables: MODE (vendor|none), GLUE, OUT_DIR, INDEX, NOTICE_FILE, LICENSE_DIR, SYSTEM_REGEX,
# READELF, LDD, DPKG_QUERY (may be empty: no package data), PATCHELF (may be empty).

cmake_minimum_required(VERSION 3.24)

set(index_file "${OUT_DIR}/${INDEX}")
set(old_files "")
if(EXISTS "${index_file}")
  file(STRINGS "${index_file}" old_files REGEX "^[^#]")
endif()

if(MODE STREQUAL "none")
  foreach(f IN LISTS old_files)
    file(REMOVE "${OUT_DIR}/${f}")
  endforeach()
  file(REMOVE "${index_file}" "${NOTICE_FILE}")
  file(REMOVE_RECURSE "${LICENSE_DIR}")
  return()
endif()

# "NEEDED;a;b;...": the dynamic section of FILE: sets <prefix>_needed, <prefix>_soname,
# <prefix>_runpath (the RPATH/RUNPATH lines, if any).
function(_kvrj_dynamic prefix file)
  execute_process(COMMAND "${READELF}" -d "${file}" OUTPUT_VARIABLE out RESULT_VARIABLE rc
                  ERROR_VARIABLE err)
  if(rc)
    message(FATAL_ERROR "readelf -d ${file}: ${err}")
  endif()
  string(REGEX MATCHALL "\\(NEEDED\\)[^\n]*\\[[^]\n]+\\]" lines "${out}")
  set(needed "")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE ".*\\[([^]]+)\\]$" "\\1" name "${line}")
    list(APPEND needed "${name}")
  endforeach()
  set(soname "")
  if(out MATCHES "\\(SONAME\\)[^\n]*\\[([^]\n]+)\\]")
    set(soname "${CMAKE_MATCH_1}")
  endif()
  string(REGEX MATCHALL "\\((RPATH|RUNPATH)\\)[^\n]*" runpath "${out}")
  set(${prefix}_needed "${needed}" PARENT_SCOPE)
  set(${prefix}_soname "${soname}" PARENT_SCOPE)
  set(${prefix}_runpath "${runpath}" PARENT_SCOPE)
endfunction()

# Where the dynamic linker finds each library of the closure, as ldd says.
execute_process(COMMAND "${LDD}" "${GLUE}" OUTPUT_VARIABLE ldd_out RESULT_VARIABLE rc
                ERROR_VARIABLE ldd_err)
if(rc)
  message(FATAL_ERROR "ldd ${GLUE}: ${ldd_err}")
endif()
string(REPLACE "\n" ";" ldd_lines "${ldd_out}")
foreach(line IN LISTS ldd_lines)
  if(line MATCHES "^[ \t]*([^ \t]+) => not found")
    message(FATAL_ERROR "kvrouter_jni: ${CMAKE_MATCH_1}, which the glue needs, is not found (ldd)")
  elseif(line MATCHES "^[ \t]*([^ \t]+) => (/[^ \t]+) \\(")
    set("path_${CMAKE_MATCH_1}" "${CMAKE_MATCH_2}")
  endif()
endforeach()

# The closure, breadth first in NEEDED order (deterministic), without the system's libraries.
_kvrj_dynamic(glue "${GLUE}")
if(glue_runpath)
  message(FATAL_ERROR "kvrouter_jni: the glue has a run path: ${glue_runpath}")
endif()
set(nodes "")
set(queue ${glue_needed})
while(queue)
  list(POP_FRONT queue name)
  if(name MATCHES "${SYSTEM_REGEX}" OR name IN_LIST nodes)
    continue()
  endif()
  if(NOT DEFINED "path_${name}")
    message(FATAL_ERROR "kvrouter_jni: ldd does not say where ${name} is")
  endif()
  list(APPEND nodes "${name}")
  _kvrj_dynamic(lib "${path_${name}}")
  if(NOT lib_soname STREQUAL name)
    # NativeLoader relies on the soname: a library loaded under another one satisfies nothing.
    message(FATAL_ERROR "kvrouter_jni: ${path_${name}} is needed as ${name} but its soname is "
                        "'${lib_soname}'")
  endif()
  set("needed_${name}" "")
  foreach(dep IN LISTS lib_needed)
    if(NOT dep MATCHES "${SYSTEM_REGEX}")
      list(APPEND "needed_${name}" "${dep}")
    endif()
  endforeach()
  set("runpath_${name}" "${lib_runpath}")
  list(APPEND queue ${lib_needed})
endwhile()

# Load order: repeatedly the first library (in discovery order) whose dependencies are all placed.
set(order "")
set(left ${nodes})
while(left)
  set(picked "")
  foreach(name IN LISTS left)
    set(ready TRUE)
    foreach(dep IN LISTS "needed_${name}")
      if(NOT dep IN_LIST order)
        set(ready FALSE)
        break()
      endif()
    endforeach()
    if(ready)
      set(picked "${name}")
      break()
    endif()
  endforeach()
  if(NOT picked)
    message(FATAL_ERROR "kvrouter_jni: a cycle among the NEEDED entries of ${left}")
  endif()
  list(APPEND order "${picked}")
  list(REMOVE_ITEM left "${picked}")
endwhile()

# What an earlier run copied and this one does not: removed.
foreach(f IN LISTS old_files)
  if(NOT f IN_LIST order)
    file(REMOVE "${OUT_DIR}/${f}")
  endif()
endforeach()

# The copies, each under its soname, with no run path.
file(MAKE_DIRECTORY "${OUT_DIR}")
foreach(name IN LISTS order)
  file(REAL_PATH "${path_${name}}" real)
  set("real_${name}" "${real}")
  file(COPY_FILE "${real}" "${OUT_DIR}/${name}" ONLY_IF_DIFFERENT)
  if(NOT "${runpath_${name}}" STREQUAL "")
    if(NOT PATCHELF)
      message(FATAL_ERROR "kvrouter_jni: ${real} has a run path (${runpath_${name}}) and "
                          "patchelf, which would remove it from the copy, is not installed")
    endif()
    execute_process(COMMAND "${PATCHELF}" --remove-rpath "${OUT_DIR}/${name}"
                    COMMAND_ERROR_IS_FATAL ANY)
  endif()
endforeach()

# Which package each file comes from (dpkg knows a file under /usr/lib or, for the packages that
# still install there, /lib: ask for both, the misses are ignored).
set(packages "")
if(DPKG_QUERY)
  set(ask "")
  foreach(name IN LISTS order)
    list(APPEND ask "${real_${name}}")
    if("${real_${name}}" MATCHES "^/usr(/lib.*)$")
      list(APPEND ask "${CMAKE_MATCH_1}")
    endif()
  endforeach()
  execute_process(COMMAND "${DPKG_QUERY}" -S ${ask} OUTPUT_VARIABLE out ERROR_QUIET)
  string(REPLACE "\n" ";" lines "${out}")
  foreach(line IN LISTS lines)
    if(line MATCHES "^([^:, ]+)(:[^:]+)?: (/.+)$")
      get_filename_component(base "${CMAKE_MATCH_3}" NAME)
      set("package_${base}" "${CMAKE_MATCH_1}")
      if(NOT CMAKE_MATCH_1 IN_LIST packages)
        list(APPEND packages "${CMAKE_MATCH_1}")
      endif()
    endif()
  endforeach()
  if(packages)
    execute_process(COMMAND "${DPKG_QUERY}" -W
                            "-f=\${Package}\t\${Version}\t\${source:Package}\t\${source:Version}\n"
                            ${packages}
                    OUTPUT_VARIABLE out ERROR_QUIET)
    string(REPLACE "\n" ";" lines "${out}")
    foreach(line IN LISTS lines)
      if(line MATCHES "^([^\t]+)\t([^\t]*)\t([^\t]*)\t([^\t]*)$")
        set("version_${CMAKE_MATCH_1}" "${CMAKE_MATCH_2}")
        set("source_${CMAKE_MATCH_1}" "${CMAKE_MATCH_3} ${CMAKE_MATCH_4}")
      endif()
    endforeach()
  endif()
endif()

# The licences a copyright file names: the DEP-5 "License:" short names in order of appearance
# (the first paragraph, "Files: *", comes first), or a pointer to the free-form text.
function(_kvrj_licences out package)
  set(file "/usr/share/doc/${package}/copyright")
  if(NOT EXISTS "${file}")
    set(${out} "unknown (no ${file})" PARENT_SCOPE)
    return()
  endif()
  file(STRINGS "${file}" lines REGEX "^License: *[^ ]")
  set(names "")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "^License: *" "" name "${line}")
    string(STRIP "${name}" name)
    if(NOT name IN_LIST names)
      list(APPEND names "${name}")
    endif()
  endforeach()
  if(names)
    string(JOIN "; " text ${names})
    set(${out} "${text}" PARENT_SCOPE)
  else()
    set(${out} "free-form copyright file, see ${package}.copyright" PARENT_SCOPE)
  endif()
endfunction()

file(REMOVE_RECURSE "${LICENSE_DIR}")
file(MAKE_DIRECTORY "${LICENSE_DIR}")
get_filename_component(license_dir_name "${LICENSE_DIR}" NAME)
set(notice "kvrouter for Java: third-party shared libraries carried in this jar\n\n")
string(APPEND notice
  "The jar's native code for linux-x86_64 (linux/x86_64/) is the JNI glue, libkvrouter_jni.so\n"
  "(kvrouter, Apache-2.0, with the C++ runtime and the static libraries it was linked with), and\n"
  "the shared libraries below, copied unmodified from the build machine's Debian packages and\n"
  "loaded from the jar by io.kvrouter.NativeLoader (listed in load order). Each package's\n"
  "copyright file is in META-INF/${license_dir_name}/<package>.copyright. The sources of a\n"
  "package are those of its Debian source package at that version (apt-get source, or\n"
  "https://snapshot.debian.org). A library can be replaced by another build of the same soname\n"
  "by replacing its file in the jar. \"licences\" are those the copyright file names, that of its\n"
  "first paragraph (usually \"Files: *\") first; the file says which part each one covers.\n\n")
foreach(name IN LISTS order)
  get_filename_component(base "${real_${name}}" NAME)
  set(package "")
  if(DEFINED "package_${base}")
    set(package "${package_${base}}")
  endif()
  string(APPEND notice "${name}\n  file:     ${real_${name}}\n")
  if(package)
    _kvrj_licences(licences "${package}")
    if(NOT EXISTS "${LICENSE_DIR}/${package}.copyright"
       AND EXISTS "/usr/share/doc/${package}/copyright")
      file(COPY_FILE "/usr/share/doc/${package}/copyright" "${LICENSE_DIR}/${package}.copyright")
    endif()
    string(APPEND notice "  package:  ${package} ${version_${package}} (source: ${source_${package}})\n"
                         "  licences: ${licences}\n")
  else()
    string(APPEND notice "  package:  unknown (not from a Debian package, or no dpkg)\n")
  endif()
endforeach()
file(WRITE "${NOTICE_FILE}" "${notice}")

string(JOIN "\n" index_text ${order})
file(WRITE "${index_file}"
  "# The shared libraries libkvrouter_jni.so needs, besides glibc's and the C++ runtime, in the\n"
  "# order io.kvrouter.NativeLoader loads them (each after those it needs), then the glue.\n"
  "${index_text}\n")
list(LENGTH order count)
message(STATUS "kvrouter_jni: vendored ${count} shared libraries next to the glue (${INDEX})")
