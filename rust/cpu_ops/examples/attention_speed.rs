//! Times paged decode attention at the default model's shapes (9 heads, 3 KV heads, 64 dims) on
//! f32, bf16 and f16 pools: `cargo run --release -p kvpark-cpu-ops --example attention_speed`.
use kvpark_cpu_ops::{decode_attention, set_threads, DecodeAttention, KvValues};
use std::time::Instant;

fn main() {
    let (heads, kv, d, cells_total, page) = (9, 3, 64, 16384, 16);
    let n = cells_total * kv * d;
    let (k32, v32) = (vec![0.01f32; n], vec![0.02f32; n]);
    // 0.01 and 0.02 in bf16 (an f32's upper half) and in f16
    let (k_bf16, v_bf16) = (vec![0x3c24u16; n], vec![0x3ca4u16; n]);
    let (k_f16, v_f16) = (vec![0x211fu16; n], vec![0x251fu16; n]);
    let pools = [
        ("f32", KvValues::F32(&k32), KvValues::F32(&v32)),
        ("bf16", KvValues::Bf16(&k_bf16), KvValues::Bf16(&v_bf16)),
        ("f16", KvValues::F16(&k_f16), KvValues::F16(&v_f16)),
    ];
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
            for (name, k, v) in pools {
                let a = DecodeAttention {
                    q: &q,
                    k,
                    v,
                    cells: &cells,
                    stride: ctx,
                    context: &context,
                    rows: &rows,
                    heads,
                    kv_heads: kv,
                    head_dim: d,
                };
                // the best of 9 runs: a shared machine's other work only ever adds time
                let ms = (0..9)
                    .map(|_| {
                        let start = Instant::now();
                        for _ in 0..30 {
                            decode_attention(a, &mut out).unwrap();
                        }
                        start.elapsed().as_secs_f64() * 1e3
                    })
                    .fold(f64::INFINITY, f64::min);
                println!(
                    "threads {threads} seqs {seqs} ctx {ctx} {name:>4}: {ms:.2} ms for 30 layers"
                );
            }
        }
    }
}
