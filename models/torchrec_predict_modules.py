"""The TorchRec models models/export_torchrec.py packages that TorchRec has
no predict module for: a two-task ranker (`TwoTowerTasks`, its predict
module and its dense network after the lookups, `TwoTaskDense`) and
DLRM_DCN behind DLRMPredictModule's interface (`DcnPredictModule`)."""

from typing import Dict, List

import torch
from torch import nn
from torchrec.inference.dlrm_predict import DLRMPredictModule
from torchrec.inference.modules import PredictModule
from torchrec.models.dlrm import DLRM_DCN
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mlp import MLP
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class TwoTowerTasks(nn.Module):
    """A two-task ranker: dense arch, pooled unweighted and weighted
    embeddings, a shared MLP and one logit head per task."""

    def __init__(self, ebc: EmbeddingBagCollection, weighted_ebc: EmbeddingBagCollection,
                 num_dense: int, dim: int, num_features: int) -> None:
        super().__init__()
        self.ebc = ebc
        self.weighted_ebc = weighted_ebc
        self.dense_arch = MLP(num_dense, [64, dim])
        self.shared = MLP(dim * (num_features + 1), [128, 64])
        self.click = nn.Linear(64, 1)
        self.conversion = nn.Linear(64, 1)

    def forward(self, dense: torch.Tensor, id_list: KeyedJaggedTensor,
                id_score_list: KeyedJaggedTensor) -> Dict[str, torch.Tensor]:
        pooled = self.ebc(id_list).values()
        weighted = self.weighted_ebc(id_score_list).values()
        hidden = self.shared(torch.cat([self.dense_arch(dense), pooled, weighted], dim=1))
        return {
            "click": torch.sigmoid(self.click(hidden)).reshape(-1),
            "conversion": torch.sigmoid(self.conversion(hidden)).reshape(-1),
        }


class TwoTaskDense(nn.Module):
    """TwoTowerTasks after its lookups: forward(dense, pooled) -> [2, B]
    (click, then conversion)."""

    def __init__(self, model: TwoTowerTasks) -> None:
        super().__init__()
        self.dense_arch = model.dense_arch
        self.shared = model.shared
        self.click = model.click
        self.conversion = model.conversion

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        hidden = self.shared(torch.cat([self.dense_arch(dense), pooled], dim=1))
        return torch.stack([torch.sigmoid(self.click(hidden)).reshape(-1),
                            torch.sigmoid(self.conversion(hidden)).reshape(-1)])


class MultiTaskPredictModule(PredictModule):
    """TorchRec's predict interface around TwoTowerTasks."""

    def __init__(self, model: TwoTowerTasks, id_list_keys: List[str], id_score_list_keys: List[str]) -> None:
        super().__init__(model, "cpu")
        self.id_list_keys: List[str] = id_list_keys
        self.id_score_list_keys: List[str] = id_score_list_keys

    def predict_forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        id_list = KeyedJaggedTensor(
            keys=self.id_list_keys,
            lengths=batch["id_list_features.lengths"],
            values=batch["id_list_features.values"],
        )
        id_score_list = KeyedJaggedTensor(
            keys=self.id_score_list_keys,
            lengths=batch["id_score_list_features.lengths"],
            values=batch["id_score_list_features.values"],
            weights=batch["id_score_list_features.weights"],
        )
        return self.predict_module(batch["float_features"], id_list, id_score_list)


class DcnPredictModule(DLRMPredictModule):
    """DLRMPredictModule's signature and forward around a DLRM_DCN (TorchRec
    has no predict module of its own for it): `float_features` and
    `id_list_features.{lengths,values}` in, `default` probabilities out."""

    def __init__(self, ebc: EmbeddingBagCollection, num_dense: int, keys: List[str], dense_arch: List[int],
                 over_arch: List[int], dcn_layers: int, dcn_rank: int) -> None:
        module = DLRM_DCN(embedding_bag_collection=ebc, dense_in_features=num_dense,
                          dense_arch_layer_sizes=dense_arch, over_arch_layer_sizes=over_arch,
                          dcn_num_layers=dcn_layers, dcn_low_rank_dim=dcn_rank, dense_device=torch.device("cpu"))
        PredictModule.__init__(self, module, torch.device("cpu"))
        self.id_list_features_keys: List[str] = keys
