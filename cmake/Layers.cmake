# The layers of libkvrouter, each a library that sees only the layers below it:
#
#   core (src/core)  <-  wire (src/wire)  <-  ingest (src/ingest)  <-  capi (src/capi)
#
# Sources include each other by layer ("core/router.h", "wire/framing.h"), so the include
# directory of every layer would be src/ itself, which shows every layer to every other. Instead
# each layer's target exposes a directory of its own in the build tree holding one link,
# <layer> -> src/<layer>: a layer sees its own headers and those of the layers it links, and an
# #include that points up a layer does not compile. scripts/check-layers.sh (a ctest test)
# checks the same on the sources, including what a relative path could sneak past the build.
function(kvr_expose_layer target layer)
  set(dir ${PROJECT_BINARY_DIR}/layers/${layer})
  file(MAKE_DIRECTORY ${dir})
  file(CREATE_LINK ${PROJECT_SOURCE_DIR}/src/${layer} ${dir}/${layer} SYMBOLIC)
  target_include_directories(${target} PUBLIC $<BUILD_INTERFACE:${dir}>)
endfunction()
