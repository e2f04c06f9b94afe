//! Row access to the KV pool from the host, on any device: the rows of given positions of one
//! sequence, read into host memory or written from it. For models whose cache streams no
//! device kernel serves yet (DeepSeek V4's compressor and indexer streams, read and written by
//! host code between device matmuls); attention-only models never call these.
//!
//! ```text
//! pool layer (either device): [block][head][slot][head_dim]      (kv_store's layout)
//! a row:  position p of one sequence = block table[p / block_size], slot p % block_size,
//!         every head: [n_kv_heads · head_dim] f32 on the host
//! ```
//! On a GPU each call is one upload of row offsets (and values), one launch and, for reads,
//! one download; it waits for the device, so it refuses to run inside a CUDA graph.

use super::{check, ComputeError, Data, Device, KvData, KvPool, Result, Tensor};
use crate::kv_store::{LayerKv, LayerKvShape};

/// Which half of a KV row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvPart {
    Keys,
    Values,
}

impl KvPool {
    /// The shape of layer (stream) `layer`, `None` past the last.
    pub fn layer_shape(&self, layer: usize) -> Option<LayerKvShape> {
        match &self.data {
            KvData::Host(c) => c.layers.get(layer).map(|l| l.shape),
            #[cfg(feature = "cuda")]
            KvData::Cuda(c) => c.layers.get(layer).map(|l| l.shape),
        }
    }

    /// Checks `layer` and that `table` maps every position to a block of the pool; returns
    /// the layer's shape and each position's `(block, slot)`.
    pub(super) fn locate(
        &self,
        layer: usize,
        table: &[u32],
        positions: &[usize],
    ) -> Result<(LayerKvShape, Vec<(usize, usize)>)> {
        let shape = self.layer_shape(layer).ok_or(ComputeError::Shape {
            what: "KV layer index (below the pool's layers)",
            got: layer,
            want: self.layers,
        })?;
        let bs = self.block_size.max(1);
        let mut at = Vec::with_capacity(positions.len());
        for &p in positions {
            let Some(&b) = table.get(p / bs) else {
                return Err(ComputeError::Shape {
                    what: "block table length (blocks covering the position read or written)",
                    got: table.len(),
                    want: p / bs + 1,
                });
            };
            if b as usize >= self.num_blocks {
                return Err(ComputeError::Shape {
                    what: "block id (below the number of blocks)",
                    got: b as usize,
                    want: self.num_blocks,
                });
            }
            at.push((b as usize, p % bs));
        }
        Ok((shape, at))
    }
}

impl Device {
    /// `[positions][n_kv_heads · head_dim]`: the keys or values of layer `layer` at
    /// `positions` of the sequence whose blocks `table` lists, in host memory.
    pub fn kv_read_rows(
        &self,
        kv: &KvPool,
        layer: usize,
        table: &[u32],
        positions: &[usize],
        part: KvPart,
    ) -> Result<Vec<f32>> {
        let (shape, at) = kv.locate(layer, table, positions)?;
        let width = shape.n_kv_heads * shape.head_dim;
        match &kv.data {
            KvData::Host(c) => {
                let mut out = vec![0f32; at.len() * width];
                for (row, &(b, s)) in out.chunks_exact_mut(width.max(1)).zip(&at) {
                    host_row(&c.layers[layer], b, s, part, row);
                }
                Ok(out)
            }
            #[cfg(feature = "cuda")]
            KvData::Cuda(c) => match self {
                Device::Cuda(g) => g.kv_read_rows(c, layer, &at, part),
                Device::Cpu => Err(super::wrong("kv_read_rows", "cuda", "cpu")),
            },
        }
    }

    /// Writes rows of layer `layer` at `positions` (distinct) of the sequence whose blocks
    /// `table` lists: `keys` and/or `values`, `[positions][n_kv_heads · head_dim]` each; a
    /// half given as `None` keeps what the pool holds.
    pub fn kv_write_rows(
        &self,
        kv: &mut KvPool,
        layer: usize,
        table: &[u32],
        positions: &[usize],
        keys: Option<&[f32]>,
        values: Option<&[f32]>,
    ) -> Result<()> {
        let (shape, at) = kv.locate(layer, table, positions)?;
        let width = shape.n_kv_heads * shape.head_dim;
        for half in [keys, values].into_iter().flatten() {
            check(
                "kv_write_rows values (positions × heads × head_dim)",
                half.len(),
                positions.len() * width,
            )?;
        }
        match &mut kv.data {
            KvData::Host(c) => {
                let l = &mut c.layers[layer];
                // The host store writes both halves at once (and quantizes them together).
                let (mut k, mut v) = (vec![0f32; width], vec![0f32; width]);
                for (i, (&p, &(b, s))) in positions.iter().zip(&at).enumerate() {
                    let r = i * width..(i + 1) * width;
                    match keys {
                        Some(x) => k.copy_from_slice(&x[r.clone()]),
                        None => host_row(l, b, s, KvPart::Keys, &mut k),
                    }
                    match values {
                        Some(x) => v.copy_from_slice(&x[r]),
                        None => host_row(l, b, s, KvPart::Values, &mut v),
                    }
                    l.write(table, p, &k, &v);
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            KvData::Cuda(c) => match self {
                Device::Cuda(g) => g.kv_write_rows(c, layer, &at, keys, values),
                Device::Cpu => Err(super::wrong("kv_write_rows", "cuda", "cpu")),
            },
        }
    }

    /// A `[rows][cols]` tensor of `values` on this device (an upload on a GPU).
    pub fn tensor(&self, rows: usize, cols: usize, values: Vec<f32>) -> Result<Tensor> {
        check("tensor values (rows × cols)", values.len(), rows * cols)?;
        let data = match self {
            Device::Cpu => Data::Host(values),
            #[cfg(feature = "cuda")]
            Device::Cuda(g) => Data::Cuda(g.upload(&values)?),
        };
        Ok(Tensor { rows, cols, data })
    }
}

/// Every head of one slot of a host layer, into `out` (`[n_kv_heads · head_dim]`).
fn host_row(l: &LayerKv, block: usize, slot: usize, part: KvPart, out: &mut [f32]) {
    for (h, o) in out.chunks_exact_mut(l.shape.head_dim.max(1)).enumerate() {
        match part {
            KvPart::Keys => l.read_keys(block as u32, h, slot, o),
            KvPart::Values => l.read_values(block as u32, h, slot, o),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_store::{KvCache, KvDtype};

    fn pool(dtype: KvDtype) -> KvPool {
        let shapes = [LayerKvShape {
            n_kv_heads: 2,
            head_dim: 3,
        }];
        KvCache::new(&shapes, 4, 2, dtype).into()
    }

    #[test]
    fn rows_written_are_read_back_through_the_table() {
        let dev = Device::Cpu;
        let mut kv = pool(KvDtype::F32);
        let table = [3u32, 0, 2];
        let keys: Vec<f32> = (0..12).map(|x| x as f32).collect();
        let vals: Vec<f32> = (0..12).map(|x| -(x as f32)).collect();
        dev.kv_write_rows(&mut kv, 0, &table, &[1, 4], Some(&keys), Some(&vals))
            .expect("write");
        let got = dev
            .kv_read_rows(&kv, 0, &table, &[4, 1], KvPart::Keys)
            .expect("read");
        assert_eq!(&got[..6], &keys[6..]);
        assert_eq!(&got[6..], &keys[..6]);
        // A values-only write keeps the keys.
        let new_vals = vec![7.0; 6];
        dev.kv_write_rows(&mut kv, 0, &table, &[4], None, Some(&new_vals))
            .expect("write values");
        let k = dev
            .kv_read_rows(&kv, 0, &table, &[4], KvPart::Keys)
            .expect("keys");
        let v = dev
            .kv_read_rows(&kv, 0, &table, &[4], KvPart::Values)
            .expect("values");
        assert_eq!((k, v), (keys[6..].to_vec(), new_vals));
    }

    #[test]
    fn positions_past_the_table_or_pool_are_refused() {
        let dev = Device::Cpu;
        let kv = pool(KvDtype::F16);
        let err = dev
            .kv_read_rows(&kv, 0, &[1], &[2], KvPart::Keys)
            .expect_err("past the table")
            .to_string();
        assert!(err.contains("block table length"), "{err}");
        let err = dev
            .kv_read_rows(&kv, 0, &[9], &[0], KvPart::Keys)
            .expect_err("block past the pool")
            .to_string();
        assert!(err.contains("block id"), "{err}");
        let err = dev
            .kv_read_rows(&kv, 1, &[0], &[0], KvPart::Keys)
            .expect_err("no layer 1")
            .to_string();
        assert!(err.contains("KV layer index"), "{err}");
    }
}
