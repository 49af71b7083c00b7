//! Copies the Triton kernels (`kernels/*.py`) into `OUT_DIR/kernels` so that maturin's
//! out-dir include ships them inside the wheel as `kvpark.kernels`. A symlink under
//! `python/` would be dropped by maturin, and a top-level include would collide with the
//! PyPI package `kernels`.
use std::{env, fs, path::PathBuf};

fn main() {
    let src = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap()).join("kernels");
    let dst = PathBuf::from(env::var("OUT_DIR").unwrap()).join("kernels");
    println!("cargo:rerun-if-changed=kernels");
    fs::create_dir_all(&dst).expect("create OUT_DIR/kernels");
    for entry in fs::read_dir(&src).expect("read kernels/") {
        let path = entry.expect("kernels/ entry").path();
        if path.extension().is_some_and(|e| e == "py") {
            println!("cargo:rerun-if-changed={}", path.display());
            fs::copy(&path, dst.join(path.file_name().unwrap())).expect("copy kernel");
        }
    }
}
