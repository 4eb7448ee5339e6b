//! The `redis` store's key layout (see [the module](super)): row `id` of a
//! table is `{PREFIX/BUCKET}ID`, its row count `{PREFIX/meta}rows`, and a
//! table's ids go bucket by bucket (one hash slot each) when written or
//! counted in bulk.

use crate::schema::RedisTableSpec;

/// Buckets per table `narsil tables load` writes unless told otherwise.
pub const DEFAULT_BUCKETS: u32 = 16;

/// The key of row `id` of the table `spec` describes.
pub fn row_key(spec: &RedisTableSpec, id: u64) -> String {
    format!("{{{}/{}}}{id}", spec.prefix, spec.bucket(id))
}

/// The key that holds the table's row count once it is loaded.
pub fn rows_key(spec: &RedisTableSpec) -> String {
    format!("{{{}/meta}}rows", spec.prefix)
}

/// The ids `0..count` of a table under `spec`, bucket by bucket (one hash
/// slot each: ids b, b + buckets, ...), in chunks of at most `chunk`.
pub fn bucket_chunks(spec: &RedisTableSpec, count: u64, chunk: usize) -> Vec<Vec<u64>> {
    let buckets = u64::from(spec.buckets);
    let mut chunks = Vec::new();
    for bucket in 0..buckets.min(count) {
        let ids: Vec<u64> = (bucket..count).step_by(buckets as usize).collect();
        chunks.extend(ids.chunks(chunk).map(<[u64]>::to_vec));
    }
    chunks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(buckets: u32) -> RedisTableSpec {
        RedisTableSpec { prefix: "narsil/dlrm/1/t_cat_0".into(), buckets }
    }

    #[test]
    fn rows_of_one_bucket_share_a_hash_tag() {
        let spec = spec(64);
        assert_eq!(row_key(&spec, 130), "{narsil/dlrm/1/t_cat_0/2}130");
        assert_eq!(row_key(&spec, 2), "{narsil/dlrm/1/t_cat_0/2}2");
        assert_eq!(rows_key(&spec), "{narsil/dlrm/1/t_cat_0/meta}rows");
    }

    #[test]
    fn the_row_count_has_a_hash_tag_of_its_own() {
        let spec = spec(16);
        let tag = |key: &str| key[..=key.find('}').unwrap()].to_string();
        let row_tags: std::collections::BTreeSet<String> =
            (0..16).map(|id| tag(&row_key(&spec, id))).collect();
        assert_eq!(row_tags.len(), 16, "one hash tag per bucket");
        assert!(!row_tags.contains(&tag(&rows_key(&spec))));
    }

    #[test]
    fn bucket_chunks_cover_every_id_once_each_chunk_within_one_bucket() {
        let spec = spec(4);
        let chunks = bucket_chunks(&spec, 22, 3);
        let mut ids: Vec<u64> = chunks.iter().flatten().copied().collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..22).collect::<Vec<_>>());
        for chunk in &chunks {
            assert!(!chunk.is_empty() && chunk.len() <= 3, "{chunk:?}");
            assert!(chunk.iter().all(|&id| spec.bucket(id) == spec.bucket(chunk[0])), "{chunk:?}");
        }
        assert_eq!(chunks[0], [0, 4, 8], "bucket by bucket, ids in order");
        assert_eq!(chunks[1], [12, 16, 20]);
    }

    #[test]
    fn a_table_smaller_than_its_buckets_gets_one_chunk_per_row() {
        assert_eq!(bucket_chunks(&spec(16), 3, 512), [vec![0], vec![1], vec![2]]);
        assert!(bucket_chunks(&spec(16), 0, 512).is_empty());
    }
}
