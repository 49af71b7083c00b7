//! Times paged decode attention at the default model's shapes (9 heads, 3 KV heads, 64 dims):
//! `cargo run --release -p kvpark-cpu-ops --example attention_speed`.
use kvpark_cpu_ops::{decode_attention, set_threads, DecodeAttention, KvValues};
use std::time::Instant;

fn main() {
    let (heads, kv, d, cells_total, page) = (9, 3, 64, 16384, 16);
    let k = vec![0.01f32; cells_total * kv * d];
    let v = vec![0.02f32; cells_total * kv * d];
    for threads in [1, 2] {
        set_threads(threads);
        for (seqs, ctx) in [(1, 260), (8, 100), (8, 260)] {
            // each sequence's pages spread over the pool, as a busy server leaves them
            let cells: Vec<i64> = (0..seqs)
                .flat_map(|b| {
                    (0..ctx)
                        .map(move |c| (((c / page) * 37 + b * 11) % 1024 * page + c % page) as i64)
                })
                .collect();
            let context = vec![ctx as i64; seqs];
            let rows: Vec<i64> = (0..seqs as i64).collect();
            let q = vec![0.1f32; seqs * heads * d];
            let mut out = vec![0.0f32; q.len()];
            let a = DecodeAttention {
                q: &q,
                k: KvValues::F32(&k),
                v: KvValues::F32(&v),
                cells: &cells,
                stride: ctx,
                context: &context,
                rows: &rows,
                heads,
                kv_heads: kv,
                head_dim: d,
            };
            let start = Instant::now();
            for _ in 0..30 {
                decode_attention(a, &mut out).unwrap();
            }
            let ms = start.elapsed().as_secs_f64() * 1e3;
            println!("threads {threads} seqs {seqs} ctx {ctx}: {ms:.2} ms for 30 layers");
        }
    }
}
