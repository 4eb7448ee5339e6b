//! Whether a new version can replace the serving one: the same requests
//! taken and the same outputs answered (table sizes may change).

use narsil_core::ModelSchema;

/// Whether `new` takes the same requests and answers the same outputs as
/// `serving`: dense count, sparse features (names, order, weighted) and
/// outputs. Table sizes may change between versions.
pub fn same_interface(serving: &ModelSchema, new: &ModelSchema) -> Result<(), String> {
    if serving.num_dense != new.num_dense {
        return Err(format!(
            "{} dense features, the served version takes {}",
            new.num_dense, serving.num_dense
        ));
    }
    let features =
        |s: &ModelSchema| s.sparse.iter().map(|f| (f.name.clone(), f.weighted)).collect::<Vec<_>>();
    if features(serving) != features(new) {
        return Err(format!(
            "sparse features {:?}, the served version takes {:?} (name, weighted)",
            features(new),
            features(serving)
        ));
    }
    if serving.outputs != new.outputs {
        return Err(format!("outputs {:?}, the served version answers {:?}", new.outputs, serving.outputs));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_version_must_take_the_same_inputs_and_answer_the_same_outputs() {
        let served = ModelSchema::dlrm("torch", "cpu", 1000);
        assert_eq!(same_interface(&served, &ModelSchema::dlrm("torch", "cpu", 5000)), Ok(()));
        let mut fewer_dense = served.clone();
        fewer_dense.num_dense = 12;
        assert!(same_interface(&served, &fewer_dense).unwrap_err().contains("12 dense"));
        let mut renamed = served.clone();
        renamed.sparse[3].name = "other".into();
        assert!(same_interface(&served, &renamed).unwrap_err().contains("sparse features"));
        let mut two_outputs = served.clone();
        two_outputs.outputs.push("task_1".into());
        assert!(same_interface(&served, &two_outputs).unwrap_err().contains("outputs"));
    }
}
