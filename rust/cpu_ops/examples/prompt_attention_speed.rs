//! Times attention over a prompt chunk: every row of one sequence at consecutive positions
//! against its cells so far (the default model's 9 heads, 3 KV heads, 64 dims; an f32 pool, its
//! pages scattered): `cargo run --release -p kvpark-cpu-ops --example prompt_attention_speed
//! [-- ROWS THREADS]`. Prints the least and the median milliseconds of 15 calls.
use kvpark_cpu_ops::{decode_attention, set_threads, DecodeAttention, KvValues};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rows: usize = args.get(1).map_or(448, |v| v.parse().expect("ROWS"));
    let threads: usize = args.get(2).map_or(1, |v| v.parse().expect("THREADS"));
    set_threads(threads);
    let (heads, kv, d, cells_total, page) = (9, 3, 64, 4096, 16);
    let n = cells_total * kv * d;
    let k: Vec<f32> = (0..n)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01)
        .collect();
    let v: Vec<f32> = (0..n)
        .map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.01)
        .collect();
    // the sequence's pages spread over the pool
    let list: Vec<i64> = (0..rows)
        .map(|c| (((c / page) * 37) % (cells_total / page) * page + c % page) as i64)
        .collect();
    let mut cells = Vec::with_capacity(rows * rows);
    for r in 0..rows {
        cells.extend_from_slice(&list[..=r]);
        cells.resize((r + 1) * rows, 0);
    }
    let context: Vec<i64> = (1..=rows as i64).collect();
    let row_ids: Vec<i64> = (0..rows as i64).collect();
    let q: Vec<f32> = (0..rows * heads * d)
        .map(|i| ((i * 29 % 89) as f32 - 44.0) * 0.01)
        .collect();
    let mut out = vec![0.0f32; q.len()];
    let a = DecodeAttention {
        q: &q,
        k: KvValues::F32(&k),
        v: KvValues::F32(&v),
        cells: &cells,
        stride: rows,
        context: &context,
        rows: &row_ids,
        heads,
        kv_heads: kv,
        head_dim: d,
    };
    let mut t: Vec<f64> = (0..15)
        .map(|_| {
            let start = Instant::now();
            decode_attention(a, &mut out).unwrap();
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(|x, y| x.partial_cmp(y).unwrap());
    println!(
        "{rows} prompt rows, {threads} threads: least {:.2} ms, median {:.2} ms (one layer)",
        t[0], t[7]
    );
}
