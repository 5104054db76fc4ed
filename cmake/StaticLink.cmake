# What a program linking the static libkvrouter.a must link as well: the external libraries
# that the core, wire and ingest layers use (Abseil's, xxHash, FlatBuffers, and the transports
# this build has), found by walking their link interfaces, as linker flags (-lNAME, in link
# order: dependents before their dependencies). kvrouter.pc lists them in Libs.private and the
# installed kvrouter::kvrouter_static target links them, so a consumer needs no find_package
# of Abseil or pkg-config module of the transports; only their development libraries on the
# linker's path.
#
#   kvr_static_link_flags(OUT target...)

# The linker flag for one link item (a library file, a bare name, or a flag), or "" to skip it.
function(_kvr_link_flag out item)
  set(flag "")
  if(item MATCHES "^-")
    set(flag "${item}")
  elseif(item MATCHES "^/.*/lib([^/]+)\\.(so|a)(\\.[0-9.]+)?$")
    set(flag "-l${CMAKE_MATCH_1}")
  elseif(item MATCHES "^[A-Za-z0-9_+.-]+$" AND NOT item MATCHES "::")
    set(flag "-l${item}")
  endif()
  set(${out} "${flag}" PARENT_SCOPE)
endfunction()

# A link item as the walk sees it: $<LINK_ONLY:x> is x; a platform condition is its content on
# this platform and nothing elsewhere; any other generator expression cannot be evaluated here.
function(_kvr_plain out item)
  string(REGEX REPLACE "^\\$<LINK_ONLY:(.*)>$" "\\1" item "${item}")
  if(item MATCHES "^\\$<\\$<PLATFORM_ID:([A-Za-z0-9_,]+)>:(.*)>$")
    string(REPLACE "," ";" platforms "${CMAKE_MATCH_1}")
    set(content "${CMAKE_MATCH_2}")
    if(CMAKE_SYSTEM_NAME IN_LIST platforms)
      set(item "${content}")
    else()
      set(item "")
    endif()
  endif()
  if(item MATCHES "^\\$<")
    message(WARNING "kvrouter: static link flags: generator expression ${item} left out")
    set(item "")
  endif()
  set(${out} "${item}" PARENT_SCOPE)
endfunction()

# Walks the link interface of `target`: each target it names first (post-order, so that a
# library's dependencies land in KVR_STATIC_WALK before it), then its own flags, then its own
# library file. kvr_static_link_flags reverses the whole, so each flag group of a target is
# appended in reverse, and a -Wl,--push-state ... -Wl,--pop-state run stays one entry.
function(_kvr_walk target)
  get_target_property(deps "${target}" INTERFACE_LINK_LIBRARIES)
  set(block "")
  if(deps)
    foreach(dep IN LISTS deps)
      _kvr_plain(dep "${dep}")
      if(dep STREQUAL "")
        continue()
      elseif(TARGET "${dep}")
        get_property(seen GLOBAL PROPERTY KVR_STATIC_SEEN)
        if(NOT "${dep}" IN_LIST seen)
          set_property(GLOBAL APPEND PROPERTY KVR_STATIC_SEEN "${dep}")
          _kvr_walk("${dep}")
        endif()
      else()
        _kvr_link_flag(flag "${dep}")
        separate_arguments(flag UNIX_COMMAND "${flag}")  # "-Wl,... -latomic" as two flags
        list(APPEND block ${flag})
      endif()
    endforeach()
  endif()
  # The block in groups: one flag, or a -Wl,--push-state ... -Wl,--pop-state run ("@@"-joined),
  # appended last first, so that the final reversal restores their order.
  set(groups "")
  set(run "")
  foreach(flag IN LISTS block)
    if(run OR flag MATCHES "^-Wl,--push-state")
      list(APPEND run "${flag}")
      if(flag MATCHES "^-Wl,--pop-state")
        string(JOIN "@@" group ${run})
        list(APPEND groups "${group}")
        set(run "")
      endif()
    else()
      list(APPEND groups "${flag}")
    endif()
  endforeach()
  if(run)
    string(JOIN "@@" group ${run})
    list(APPEND groups "${group}")
  endif()
  list(REVERSE groups)
  foreach(group IN LISTS groups)
    set_property(GLOBAL APPEND PROPERTY KVR_STATIC_WALK "${group}")
  endforeach()
  get_target_property(type "${target}" TYPE)
  get_target_property(imported "${target}" IMPORTED)
  if(imported AND NOT type STREQUAL "INTERFACE_LIBRARY")
    get_target_property(location "${target}" IMPORTED_LOCATION)
    get_target_property(configs "${target}" IMPORTED_CONFIGURATIONS)
    if(NOT location AND configs)
      list(GET configs 0 config)
      get_target_property(location "${target}" IMPORTED_LOCATION_${config})
    endif()
    if(location)
      _kvr_link_flag(flag "${location}")
      set_property(GLOBAL APPEND PROPERTY KVR_STATIC_WALK "${flag}")
    endif()
  endif()
endfunction()

function(kvr_static_link_flags out)
  set_property(GLOBAL PROPERTY KVR_STATIC_SEEN "${ARGN}")  # the roots are bundled, not linked
  set_property(GLOBAL PROPERTY KVR_STATIC_WALK "")
  foreach(root IN LISTS ARGN)
    _kvr_walk("${root}")
  endforeach()
  get_property(walk GLOBAL PROPERTY KVR_STATIC_WALK)
  list(REVERSE walk)  # dependents before their dependencies
  list(REMOVE_DUPLICATES walk)
  string(REPLACE "@@" ";" walk "${walk}")
  # A C program links the C++ runtime itself.
  list(APPEND walk -lstdc++ -lm)
  set(${out} "${walk}" PARENT_SCOPE)
endfunction()
