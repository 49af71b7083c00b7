//! Times the int8 block products at decode and prompt row counts for every block kind, at the
//! default model's layer shapes (SmolLM2-135M: k = 576 with n = 960 fused qkv and 3072 gate_up;
//! k = 1536 with n = 576 down): `cargo run --release --example gemm_speed -p kvpark-cpu-ops
//! [-- THREADS [ROWS,ROWS,...]]`, then the dense products (f32, f16 and bf16 values by f32
//! activations, and bf16 values by bf16 activations as `BF16x16`, `dense/bf16_pairs.rs`) at
//! the same shapes. Prints the median microseconds per product and the
//! multiply-adds per nanosecond it reached (weights in cache after the first call: at many rows a
//! product is bound by arithmetic, not memory). `KVPARK_CPU_ISA` and `KVPARK_CPU_SIDE_BY_SIDE`
//! select the kernels, as everywhere; `GEMM_SPEED_KIND=Q8` (a kind's name as printed) times that
//! kind alone.
use kvpark_cpu_ops::{
    dense::bf16_pairs, matmul_bf16_pairs, matmul_dense, matmul_i8, set_threads, DenseKernel,
    DenseValues, DenseWeights, I8Kernel, I8Scratch, Iq4Weights, PairKernel, Q4Weights, Q6Weights,
    Q8Packing, Q8Weights, Weights,
};
use std::time::Instant;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Kind {
    Q4,
    Q8,
    Q8Offset,
    Q6,
    Iq4,
}

struct Matrix {
    qs: Vec<u8>,
    scale: Vec<f32>,
    offset: Vec<f32>,
    n: usize,
    k: usize,
    kind: Kind,
}

impl Matrix {
    fn new(n: usize, k: usize, kind: Kind) -> Matrix {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            (seed >> 33) as u32
        };
        let bytes = if matches!(kind, Kind::Q4 | Kind::Iq4) {
            n * k / 2
        } else {
            n * k
        };
        let scales = n * k / if kind == Kind::Q6 { 16 } else { 32 };
        Matrix {
            qs: (0..bytes).map(|_| next() as u8).collect(),
            scale: (0..scales).map(|_| (next() % 1000) as f32 * 1e-5).collect(),
            offset: (0..scales)
                .map(|_| -((next() % 1000) as f32) * 8e-5)
                .collect(),
            n,
            k,
            kind,
        }
    }

    fn weights(&self) -> Weights<'_> {
        // SAFETY: u8 and i8 share size, alignment and valid bit patterns.
        let signed =
            unsafe { std::slice::from_raw_parts(self.qs.as_ptr() as *const i8, self.qs.len()) };
        let (n, k) = (self.n, self.k);
        match self.kind {
            Kind::Q4 => Weights::Q4(Q4Weights {
                qs: &self.qs,
                scale: &self.scale,
                offset: &self.offset,
                n,
                k,
                packed: false,
            }),
            Kind::Q8 | Kind::Q8Offset => Weights::Q8(Q8Weights {
                qs: signed,
                scale: &self.scale,
                offset: (self.kind == Kind::Q8Offset).then_some(&self.offset[..]),
                n,
                k,
                low: None,
                packed: Q8Packing::Rows,
            }),
            Kind::Q6 => Weights::Q6(Q6Weights {
                qs: signed,
                scale: &self.scale,
                n,
                k,
                low: None,
                packed: false,
            }),
            Kind::Iq4 => Weights::Iq4(Iq4Weights {
                qs: &self.qs,
                scale: &self.scale,
                n,
                k,
            }),
        }
    }
}

fn median_us(samples: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..samples)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    t[samples / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).map_or(2, |t| t.parse().expect("THREADS"));
    let row_counts: Vec<usize> = args.get(2).map_or(vec![1, 8, 64, 448], |r| {
        r.split(',').map(|v| v.parse().expect("ROWS")).collect()
    });
    set_threads(threads);
    let kernel = I8Kernel::best();
    println!("int8 kernel {}, {threads} threads", kernel.name());
    println!(
        "{:<8} {:>5} {:>5} {:>5} {:>10} {:>8}",
        "kind", "n", "k", "rows", "median us", "MAC/ns"
    );
    let mut scratch = I8Scratch::new();
    for kind in [Kind::Q4, Kind::Q8, Kind::Q8Offset, Kind::Q6, Kind::Iq4] {
        if std::env::var("GEMM_SPEED_DENSE_ONLY").is_ok() {
            break;
        }
        if std::env::var("GEMM_SPEED_KIND").is_ok_and(|only| only != format!("{kind:?}")) {
            continue;
        }
        for (n, k) in [(960, 576), (3072, 576), (576, 1536)] {
            let m = Matrix::new(n, k, kind);
            for &rows in &row_counts {
                let x: Vec<f32> = (0..rows * k)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.02)
                    .collect();
                let mut y = vec![0.0f32; rows * n];
                let samples = (2000 / rows).clamp(15, 301);
                let us = median_us(samples, || {
                    matmul_i8(&x, rows, m.weights(), &mut y, kernel, &mut scratch).unwrap()
                });
                let macs = (rows * n * k) as f64;
                println!(
                    "{:<8} {n:>5} {k:>5} {rows:>5} {us:>10.1} {:>8.1}",
                    format!("{kind:?}"),
                    macs / (us * 1e3)
                );
            }
        }
    }
    dense(&row_counts);
}

/// The dense kernels at the same shapes and row counts.
fn dense(row_counts: &[usize]) {
    println!("dense kernel {}", DenseKernel::best().name());
    for (n, k) in [(960, 576), (3072, 576), (576, 1536)] {
        let f32s: Vec<f32> = (0..n * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 1e-3)
            .collect();
        let halves: Vec<u16> = f32s.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        for (name, values) in [
            ("F32", DenseValues::F32(&f32s)),
            ("F16", DenseValues::F16(&halves)),
            ("BF16", DenseValues::Bf16(&halves)),
        ] {
            let w = DenseWeights { values, n, k };
            for &rows in row_counts {
                let x: Vec<f32> = (0..rows * k)
                    .map(|i| ((i * 29 % 89) as f32 - 44.0) * 0.02)
                    .collect();
                let mut y = vec![0.0f32; rows * n];
                let samples = (2000 / rows).clamp(15, 301);
                let us = median_us(samples, || {
                    matmul_dense(&x, rows, w, &mut y, DenseKernel::best()).unwrap()
                });
                let macs = (rows * n * k) as f64;
                println!(
                    "{name:<8} {n:>5} {k:>5} {rows:>5} {us:>10.1} {:>8.1}",
                    macs / (us * 1e3)
                );
                if name == "BF16" && bf16_pairs::applies(&w) {
                    let us = median_us(samples, || {
                        matmul_bf16_pairs(&x, rows, w, &mut y, PairKernel::best()).unwrap()
                    });
                    println!(
                        "{:<8} {n:>5} {k:>5} {rows:>5} {us:>10.1} {:>8.1}",
                        "BF16x16",
                        macs / (us * 1e3)
                    );
                }
            }
        }
    }
}
