//! Times the block products over the default model's 30 layers (SmolLM2-135M shapes, Q4 layers
//! and a Q8 head, ~86 MB, so nothing stays in cache): `cargo run --release --example speed`.
use kvpark_cpu_ops::{matmul_q4, matmul_q8, set_threads, Q4Weights, Q8Packing, Q8Weights};
use std::time::Instant;

struct Q4 {
    qs: Vec<u8>,
    scale: Vec<f32>,
    offset: Vec<f32>,
    n: usize,
    k: usize,
}

fn q4(n: usize, k: usize) -> Q4 {
    let qs = (0..n * k / 2).map(|i| (i * 7) as u8).collect();
    Q4 {
        qs,
        scale: vec![0.01; n * k / 32],
        offset: vec![-0.05; n * k / 32],
        n,
        k,
    }
}

fn main() {
    let layers: Vec<Vec<Q4>> = (0..30)
        .map(|_| vec![q4(960, 576), q4(576, 576), q4(3072, 576), q4(576, 1536)])
        .collect();
    let (hn, hk) = (49152, 576);
    let head_qs: Vec<i8> = (0..hn * hk).map(|i| (i % 251) as i8).collect();
    let head_scale = vec![0.01f32; hn * hk / 32];
    for threads in [1, 2] {
        set_threads(threads);
        for rows in [1, 8, 16] {
            let x = vec![0.5f32; rows * 1536];
            let mut y = vec![0.0f32; rows * hn];
            let mut times = Vec::new();
            for _ in 0..7 {
                let start = Instant::now();
                for layer in &layers {
                    for w in layer {
                        let v = Q4Weights {
                            qs: &w.qs,
                            scale: &w.scale,
                            offset: &w.offset,
                            n: w.n,
                            k: w.k,
                            packed: false,
                        };
                        matmul_q4(&x[..rows * w.k], rows, v, &mut y[..rows * w.n]).unwrap();
                    }
                }
                let layers_ms = start.elapsed().as_secs_f64() * 1e3;
                let head = Q8Weights {
                    qs: &head_qs,
                    scale: &head_scale,
                    offset: None,
                    n: hn,
                    k: hk,
                    low: None,
                    packed: Q8Packing::Rows,
                };
                let start = Instant::now();
                matmul_q8(&x[..rows * hk], rows, head, &mut y).unwrap();
                times.push((layers_ms, start.elapsed().as_secs_f64() * 1e3));
            }
            times.sort_by(|a, b| (a.0 + a.1).partial_cmp(&(b.0 + b.1)).unwrap());
            let (l, h) = times[3];
            println!("threads {threads} rows {rows:2}: layers {l:.1} ms + head {h:.1} ms");
        }
    }
}
