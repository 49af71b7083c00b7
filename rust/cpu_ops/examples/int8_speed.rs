//! Times the f32-expansion products against the int8 ones at the default model's shapes
//! (SmolLM2-135M: k = 576 with n = 960 fused qkv, 576 o, 3072 gate_up; k = 1536 n = 576 down;
//! the Q8_0 head k = 576 n = 49152), and down and the head as Q6_K (int8 quants, a scale per 16)
//! as a Q4_K_M file stores them: `cargo run --release --example int8_speed -p kvpark-cpu-ops`.
//!
//! Each shape cycles through copies of its weights totalling over 96 MiB, so every product reads
//! them from memory as a decode step does (the model is bigger than any cache). Prints the
//! median microseconds per product.
use kvpark_cpu_ops::{
    matmul_i8, matmul_q4, matmul_q6, matmul_q8, set_threads, I8Kernel, I8Scratch, Q4Weights,
    Q6Weights, Q8Packing, Q8Weights, Weights,
};
use std::time::Instant;

/// Weight bytes each shape's copies add up to at least.
const SPAN: usize = 96 << 20;
/// Products timed per (shape, rows, threads, path); the median is printed.
const SAMPLES: usize = 301;

struct Shape {
    name: &'static str,
    n: usize,
    k: usize,
    kind: Kind,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Q4,
    Q8,
    Q6,
}

/// One copy of a matrix's arrays.
struct Copy {
    qs: Vec<u8>,
    scale: Vec<f32>,
    offset: Vec<f32>,
}

fn weights<'a>(s: &Shape, c: &'a Copy) -> Weights<'a> {
    // SAFETY: u8 and i8 share size, alignment and valid bit patterns.
    let signed = unsafe { std::slice::from_raw_parts(c.qs.as_ptr() as *const i8, c.qs.len()) };
    let (n, k) = (s.n, s.k);
    match s.kind {
        Kind::Q8 => Weights::Q8(Q8Weights {
            qs: signed,
            scale: &c.scale,
            offset: None,
            n,
            k,
            low: None,
            packed: Q8Packing::Rows,
        }),
        Kind::Q6 => Weights::Q6(Q6Weights {
            qs: signed,
            scale: &c.scale,
            n,
            k,
            low: None,
            packed: false,
        }),
        Kind::Q4 => Weights::Q4(Q4Weights {
            qs: &c.qs,
            scale: &c.scale,
            offset: &c.offset,
            n,
            k,
            packed: false,
        }),
    }
}

fn copies(s: &Shape) -> Vec<Copy> {
    let blocks = s.n * s.k / if s.kind == Kind::Q6 { 16 } else { 32 };
    let bytes = if s.kind == Kind::Q4 {
        s.n * s.k / 2
    } else {
        s.n * s.k
    };
    let mut seed = 1u64;
    let mut next = || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        (seed >> 33) as u32
    };
    let one = Copy {
        qs: (0..bytes).map(|_| next() as u8).collect(),
        scale: (0..blocks).map(|_| (next() % 1000) as f32 * 1e-5).collect(),
        offset: (0..blocks)
            .map(|_| -((next() % 1000) as f32) * 8e-5)
            .collect(),
    };
    let size = bytes + blocks * 8;
    let count = SPAN.div_ceil(size).max(2);
    (0..count)
        .map(|_| Copy {
            qs: one.qs.clone(),
            scale: one.scale.clone(),
            offset: one.offset.clone(),
        })
        .collect()
}

/// Median microseconds of `SAMPLES` calls of `f(copy index)`.
fn median_us(count: usize, mut f: impl FnMut(usize)) -> f64 {
    for i in 0..count.min(8) {
        f(i); // warm the threads and the allocator
    }
    let mut t: Vec<f64> = (0..SAMPLES)
        .map(|i| {
            let start = Instant::now();
            f(i % count);
            start.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    t[SAMPLES / 2]
}

fn main() {
    let shapes = [
        Shape {
            name: "qkv q4",
            n: 960,
            k: 576,
            kind: Kind::Q4,
        },
        Shape {
            name: "o q4",
            n: 576,
            k: 576,
            kind: Kind::Q4,
        },
        Shape {
            name: "gate_up q4",
            n: 3072,
            k: 576,
            kind: Kind::Q4,
        },
        Shape {
            name: "down q4",
            n: 576,
            k: 1536,
            kind: Kind::Q4,
        },
        Shape {
            name: "head q8_0",
            n: 49152,
            k: 576,
            kind: Kind::Q8,
        },
        Shape {
            name: "down q6_k",
            n: 576,
            k: 1536,
            kind: Kind::Q6,
        },
        Shape {
            name: "head q6_k",
            n: 49152,
            k: 576,
            kind: Kind::Q6,
        },
    ];
    let kernel = I8Kernel::best();
    println!("int8 kernel: {}; median us per product", kernel.name());
    println!(
        "{:<11} {:>4} {:>7} {:>9} {:>9} {:>7}",
        "shape", "rows", "threads", "f32", "int8", "ratio"
    );
    let mut scratch = I8Scratch::new();
    for s in &shapes {
        let all = copies(s);
        for rows in [1, 8] {
            let x: Vec<f32> = (0..rows * s.k)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.02)
                .collect();
            let mut y = vec![0.0f32; rows * s.n];
            for threads in [1, 2] {
                set_threads(threads);
                let f32_us = median_us(all.len(), |i| match weights(s, &all[i]) {
                    Weights::Q4(w) => matmul_q4(&x, rows, w, &mut y).unwrap(),
                    Weights::Q8(w) => matmul_q8(&x, rows, w, &mut y).unwrap(),
                    Weights::Q6(w) => matmul_q6(&x, rows, w, &mut y).unwrap(),
                    Weights::Iq4(_) | Weights::Dense(_) => unreachable!("not made here"),
                });
                let i8_us = median_us(all.len(), |i| {
                    matmul_i8(&x, rows, weights(s, &all[i]), &mut y, kernel, &mut scratch).unwrap()
                });
                println!(
                    "{:<11} {rows:>4} {threads:>7} {f32_us:>9.1} {i8_us:>9.1} {:>6.2}x",
                    s.name,
                    f32_us / i8_us
                );
            }
        }
    }
}
