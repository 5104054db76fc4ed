//! Finds libkvrouter for linking:
//!
//! * `KVROUTER_LIB_DIR` set: link from that directory (headers in `KVROUTER_INCLUDE_DIR`, else
//!   `$KVROUTER_LIB_DIR/../include`); pkg-config is not consulted, and the headers'
//!   `kvrouter_version.h`, when there is one, must name the same major.minor (without it the
//!   only check is the safe crate's at run time). With the `static` feature, libkvrouter.a is
//!   linked from there, and its private dependencies are named by `KVROUTER_STATIC_LIBS`
//!   (space-separated library names, e.g. the `-l` names of kvrouter.pc's `Libs.private`).
//! * otherwise: the `pkg-config` crate probes `kvrouter.pc` for `0.2 <= version < 0.3`, the
//!   major.minor these declarations mirror (the usual `PKG_CONFIG*` variables apply, and
//!   `KVROUTER_NO_PKG_CONFIG` turns the probe off). Shared: the crate prints the link flags.
//!   With the `static` feature: `pkg-config --static`, so `Libs.private` comes too; libkvrouter.a
//!   is linked from the `.pc` file's `libdir` and every other library dynamically (they are the
//!   system's: Abseil, libzmq, libuv, NATS, libstdc++).
//!
//! It also publishes the include directory: `DEP_KVROUTER_INCLUDE` for dependents, and
//! `KVROUTER_SYS_INCLUDE_DIR` for this crate's layout test.

use std::env;
use std::path::{Path, PathBuf};

/// The C library's major.minor that `src/lib.rs` mirrors; the probe accepts any patch of it.
const MIN_VERSION: &str = "0.2";
/// The first version the declarations may not match (the next minor: the ABI may change at 0.x).
const NEXT_MINOR: &str = "0.3";

fn main() {
    // The declarations (and their layout asserts) are clang's 64-bit layout of the header, and
    // the library is built for 64-bit targets only: say so rather than fail in a wall of
    // layout asserts.
    let width = env::var("CARGO_CFG_TARGET_POINTER_WIDTH").unwrap_or_default();
    if width != "64" {
        panic!(
            "kvrouter-sys supports 64-bit targets only (this target's pointers are {width} \
             bits): its declarations mirror the header's 64-bit layout"
        );
    }
    for var in [
        "KVROUTER_LIB_DIR",
        "KVROUTER_INCLUDE_DIR",
        "KVROUTER_STATIC_LIBS",
    ] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    println!("cargo::rerun-if-changed=build.rs");
    let statik = env::var_os("CARGO_FEATURE_STATIC").is_some();

    let include_dir = match env::var_os("KVROUTER_LIB_DIR") {
        Some(lib_dir) => {
            let lib_dir = PathBuf::from(lib_dir);
            println!("cargo::rustc-link-search=native={}", lib_dir.display());
            if statik {
                require_archive(&lib_dir, "KVROUTER_LIB_DIR");
                println!("cargo::rustc-link-lib=static=kvrouter");
                let private = env::var("KVROUTER_STATIC_LIBS").unwrap_or_default();
                for lib in private.split_whitespace() {
                    println!("cargo::rustc-link-lib=dylib={lib}");
                }
            } else {
                println!("cargo::rustc-link-lib=dylib=kvrouter");
            }
            env::var_os("KVROUTER_INCLUDE_DIR")
                .map(PathBuf::from)
                .or_else(|| Some(lib_dir.join("..").join("include")))
        }
        None if statik => probe_static(),
        None => probe_shared(),
    };

    let header = include_dir
        .as_deref()
        .map(|dir| dir.join("kvrouter.h"))
        .filter(|h| h.is_file());
    if let Some(h) = &header {
        println!("cargo::rerun-if-changed={}", h.display());
        let dir = h.parent().unwrap();
        check_header_version(&dir.join("kvrouter_version.h"));
        println!("cargo::metadata=include={}", dir.display());
        println!(
            "cargo::rustc-env=KVROUTER_SYS_INCLUDE_DIR={}",
            dir.display()
        );
    } else {
        println!(
            "cargo::warning=kvrouter-sys: kvrouter.h not found: the library's version is checked \
             at run time only"
        );
        println!("cargo::rustc-env=KVROUTER_SYS_INCLUDE_DIR=");
    }
}

/// Refuses headers of another major.minor than `MIN_VERSION` (kvrouter_version.h's
/// `KVR_VERSION_MAJOR` / `KVR_VERSION_MINOR`); warns when there is no such file.
fn check_header_version(path: &Path) {
    let Ok(text) = std::fs::read_to_string(path) else {
        println!(
            "cargo::warning=kvrouter-sys: no {}: the library's version is checked at run time only",
            path.display()
        );
        return;
    };
    println!("cargo::rerun-if-changed={}", path.display());
    let number = |name: &str| {
        text.lines()
            .filter_map(|l| l.trim().strip_prefix("#define "))
            .find_map(|l| l.strip_prefix(name)?.trim().parse::<u32>().ok())
    };
    let found = number("KVR_VERSION_MAJOR").zip(number("KVR_VERSION_MINOR"));
    let found = found.map(|(major, minor)| format!("{major}.{minor}"));
    if found.as_deref() != Some(MIN_VERSION) {
        panic!(
            "kvrouter-sys: {} is for kvrouter {}, but these declarations mirror {MIN_VERSION}.x \
             (the ABI may change between 0.x minor releases); use a matching kvrouter-sys",
            path.display(),
            found.as_deref().unwrap_or("an unknown version"),
        );
    }
}

/// `kvrouter` with the version range: pkg-config gets `kvrouter >= 0.2` and `kvrouter < 0.3`
/// as two constraints, which pkgconf and pkg-config both enforce. A failure panics naming the
/// version found, if any.
fn probe(statik: bool) -> pkg_config::Library {
    let mut config = pkg_config::Config::new();
    config
        .range_version(MIN_VERSION..NEXT_MINOR)
        .statik(statik)
        // Static: the link flags are printed below (see probe_static).
        .cargo_metadata(!statik);
    match config.probe("kvrouter") {
        Ok(library) => library,
        Err(e) => {
            // Again without the range, only to name what was found.
            let found = pkg_config::Config::new()
                .cargo_metadata(false)
                .env_metadata(false)
                .probe("kvrouter")
                .ok();
            match found {
                Some(lib) if major_minor(&lib.version) >= major_minor(NEXT_MINOR) => panic!(
                    "kvrouter-sys: kvrouter {} is installed, but these declarations mirror \
                     {MIN_VERSION}.x (the ABI may change between 0.x minor releases); use a \
                     matching kvrouter-sys",
                    lib.version
                ),
                found => panic!(
                    "kvrouter-sys: kvrouter {MIN_VERSION}.x is required, pkg-config found {}; \
                     set PKG_CONFIG_PATH to the directory holding kvrouter.pc (e.g. \
                     <prefix>/lib/pkgconfig), or KVROUTER_LIB_DIR to the library's directory\n\
                     {e}",
                    found.map_or("none".to_string(), |lib| lib.version),
                ),
            }
        }
    }
}

/// The include directory of a probed library: the first `-I` of its Cflags (a `.pc` in a
/// system prefix has none, since pkg-config leaves out system directories), else its
/// `includedir` variable.
fn include_dir(library: &pkg_config::Library) -> Option<PathBuf> {
    library.include_paths.first().cloned().or_else(|| {
        pkg_config::get_variable("kvrouter", "includedir")
            .ok()
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
    })
}

/// libkvrouter.so: the pkg-config crate prints `-L` and `-lkvrouter` as cargo directives.
fn probe_shared() -> Option<PathBuf> {
    include_dir(&probe(false))
}

/// libkvrouter.a and its private dependencies (`pkg-config --static --libs`). The link flags
/// are printed here rather than by the pkg-config crate, which links a library statically only
/// when its archive lies outside the system prefix: the Debian package's libkvrouter.a is in
/// /usr/lib/<triplet>, which it would link as the shared library without a word. Here
/// libkvrouter.a is required in the `.pc` file's `libdir`, and the rest (`Libs.private`:
/// Abseil, libzmq, libuv, NATS, libstdc++, libm) is linked dynamically, in pkg-config's order.
fn probe_static() -> Option<PathBuf> {
    let library = probe(true);
    let libdir = pkg_config::get_variable("kvrouter", "libdir")
        .map(PathBuf::from)
        .unwrap_or_else(|e| panic!("kvrouter-sys: kvrouter.pc has no libdir: {e}"));
    require_archive(&libdir, "kvrouter.pc's libdir");
    println!("cargo::rustc-link-search=native={}", libdir.display());
    for dir in library.link_paths.iter().filter(|d| **d != libdir) {
        println!("cargo::rustc-link-search=native={}", dir.display());
    }
    println!("cargo::rustc-link-lib=static=kvrouter");
    for lib in library.libs.iter().filter(|l| *l != "kvrouter") {
        println!("cargo::rustc-link-lib=dylib={lib}");
    }
    include_dir(&library)
}

/// "MAJOR.MINOR[.PATCH...]" as numbers, for comparing versions (None sorts first).
fn major_minor(version: &str) -> Option<(u32, u32)> {
    let mut parts = version.trim().split('.').map(|p| p.parse::<u32>().ok());
    Some((parts.next()??, parts.next()??))
}

fn require_archive(dir: &Path, what: &str) {
    let archive = dir.join("libkvrouter.a");
    if !archive.is_file() {
        panic!(
            "kvrouter-sys: the `static` feature needs {} ({what}); install the static library \
             (libkvrouter-dev, or a build with KVR_BUILD_STATIC=ON)",
            archive.display()
        );
    }
    println!("cargo::rerun-if-changed={}", archive.display());
}
