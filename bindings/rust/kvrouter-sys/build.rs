//! Finds libkvrouter for linking, with no third-party crates:
//!
//! * `KVROUTER_LIB_DIR` set: link from that directory (headers in `KVROUTER_INCLUDE_DIR`, else
//!   `$KVROUTER_LIB_DIR/../include`); pkg-config is not consulted, and the headers'
//!   `kvrouter_version.h`, when there is one, must name the same major.minor (without it the
//!   only check is the safe crate's at run time).
//! * otherwise: runs `pkg-config` itself (the `PKG_CONFIG` variable names another binary) and
//!   requires `0.2 <= version < 0.3`, the major.minor these declarations mirror.
//!
//! It also publishes the include directory: `DEP_KVROUTER_INCLUDE` for dependents, and
//! `KVROUTER_SYS_INCLUDE_DIR` for this crate's layout test.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The C library's major.minor that `src/lib.rs` mirrors; the probe accepts any patch of it.
const MIN_VERSION: &str = "0.2";
/// The first version the declarations may not match (the next minor: the ABI may change at 0.x).
const NEXT_MINOR: &str = "0.3";

fn main() {
    for var in [
        "KVROUTER_LIB_DIR",
        "KVROUTER_INCLUDE_DIR",
        "PKG_CONFIG",
        "PKG_CONFIG_PATH",
        "PKG_CONFIG_LIBDIR",
        "PKG_CONFIG_SYSROOT_DIR",
    ] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    println!("cargo::rerun-if-changed=build.rs");

    let include_dir = match env::var_os("KVROUTER_LIB_DIR") {
        Some(lib_dir) => {
            let lib_dir = PathBuf::from(lib_dir);
            println!("cargo::rustc-link-search=native={}", lib_dir.display());
            println!("cargo::rustc-link-lib=dylib=kvrouter");
            env::var_os("KVROUTER_INCLUDE_DIR")
                .map(PathBuf::from)
                .or_else(|| Some(lib_dir.join("..").join("include")))
        }
        None => probe_pkg_config(),
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

fn pkg_config() -> Command {
    Command::new(env::var_os("PKG_CONFIG").unwrap_or_else(|| "pkg-config".into()))
}

/// Runs `pkg-config ARGS kvrouter`: Some(stdout) on success, None when it exits non-zero.
fn run_pkg_config(args: &[&str]) -> Option<String> {
    let output = pkg_config()
        .args(args)
        .arg("kvrouter")
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "kvrouter-sys: cannot run pkg-config ({e}); install it, or set KVROUTER_LIB_DIR \
                 to the directory holding libkvrouter.so"
            )
        });
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

fn probe_pkg_config() -> Option<PathBuf> {
    // Two invocations: pkgconf honours only the last of --atleast-version / --max-version when
    // both are given, so a combined probe would silently skip one bound.
    if run_pkg_config(&["--atleast-version", MIN_VERSION]).is_none() {
        let found = run_pkg_config(&["--modversion"]);
        panic!(
            "kvrouter-sys: kvrouter {MIN_VERSION}.x is required, pkg-config found {}; set \
             PKG_CONFIG_PATH to the directory holding kvrouter.pc (e.g. \
             <prefix>/lib/pkgconfig), or KVROUTER_LIB_DIR to the library's directory",
            found.map_or("none".to_string(), |v| v.trim().to_string()),
        );
    }
    if run_pkg_config(&["--atleast-version", NEXT_MINOR]).is_some() {
        let found = run_pkg_config(&["--modversion"]).unwrap_or_default();
        panic!(
            "kvrouter-sys: kvrouter {} is installed, but these declarations mirror {MIN_VERSION}.x \
             (the ABI may change between 0.x minor releases); use a matching kvrouter-sys",
            found.trim()
        );
    }
    let libs = run_pkg_config(&["--libs"]).expect("pkg-config --libs kvrouter failed");
    let mut linked = false;
    for flag in libs.split_whitespace() {
        if let Some(dir) = flag.strip_prefix("-L") {
            println!("cargo::rustc-link-search=native={dir}");
        } else if let Some(lib) = flag.strip_prefix("-l") {
            println!("cargo::rustc-link-lib=dylib={lib}");
            linked |= lib == "kvrouter";
        }
    }
    if !linked {
        println!("cargo::rustc-link-lib=dylib=kvrouter");
    }
    run_pkg_config(&["--variable=includedir"])
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
}
