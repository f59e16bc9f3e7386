"""The detection path (torchvision Faster / Mask R-CNN on a Swin backbone with our norms) on
generated shapes: data, COCO evaluation, training, resume, collapse, folding."""
from __future__ import annotations

import contextlib
import json
import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO

import plugins.torchvision.trainer as trainer
import unnorm
from plugins.checkpoints import load_checkpoint
from plugins.distributed import Distributed
from plugins.runlog import DETECTION_PROBE_EXAMPLES, FINISHED, SCALE_INVARIANCE_FILE
from plugins.scale import effective_config
from plugins.torchvision.coco import CocoInstances, coco_evaluate, to_coco_results
from plugins.torchvision.detectors import build_detector, detector_fold_plan, fold_detector
from plugins.torchvision.shapes import CATEGORIES, ensure_shapes, render_image
from plugins.torchvision.trainer import build_datasets, evaluate, train
from test_vision import ROOT, assert_states_equal, config, kill_and_resume, run_script, two_replicas

QUICK = ["scale=cpu", "logger=none", "recipe.epochs=1", "scale.max_steps_per_epoch=2"]


def _data(tmp_path, train=16, val=4):
    """The generated shapes, chosen explicitly so their size can be set."""
    return ["data=shapes", f"data.root={tmp_path / 'shapes'}", f"data.generate.num_train={train}",
            f"data.generate.num_val={val}"]


def _coco(images: list[dict], annotations: list[dict]) -> COCO:
    coco = COCO()
    coco.dataset = {"images": images, "annotations": annotations, "categories": CATEGORIES}
    coco.createIndex()
    return coco


def _box_annotation(ann_id, image_id, box, category=1):
    x, y, w, h = box
    return {"id": ann_id, "image_id": image_id, "category_id": category, "bbox": box,
            "area": w * h, "iscrowd": 0,
            "segmentation": [[x, y, x + w, y, x + w, y + h, x, y + h]]}


def test_coco_ap_of_known_predictions():
    """Closed forms: exact boxes score 100; a false positive ranked above the only true one
    halves precision at every recall (AP 50); a box at IoU 0.58 is a hit at thresholds 0.50
    and 0.55 only, 2 of COCO's 10 (AP 20, AP50 100, AP75 0)."""
    images = [{"id": 1, "width": 200, "height": 200}]
    coco = _coco(images, [_box_annotation(1, 1, [20, 20, 100, 100])])
    exact = [{"image_id": 1, "category_id": 1, "bbox": [20, 20, 100, 100], "score": 0.9}]
    assert coco_evaluate(coco, exact)["bbox_AP"] == pytest.approx(100)
    decoy = {"image_id": 1, "category_id": 1, "bbox": [150, 150, 40, 40], "score": 0.95}
    assert coco_evaluate(coco, exact + [decoy])["bbox_AP"] == pytest.approx(50)
    # IoU of [20, 20, 100, 100] with [20, 20, 100, 58] is 0.58
    partial = coco_evaluate(coco, [{**exact[0], "bbox": [20, 20, 100, 58]}])
    assert partial["bbox_AP"] == pytest.approx(20)
    assert partial["bbox_AP50"] == pytest.approx(100) and partial["bbox_AP75"] == pytest.approx(0)
    assert coco_evaluate(coco, [])["bbox_AP"] == 0.0


def test_detector_outputs_convert_to_coco_results_that_score_perfectly(tmp_path):
    """Ground truth fed back as torchvision predictions (XYXY boxes, soft masks) gives box and
    mask AP of 100: the conversion to COCO results loses nothing."""
    root = ensure_shapes(tmp_path, num_train=2, num_val=6, size=96)
    val = CocoInstances(root / "val", root / "annotations" / "instances_val.json", train=False)
    results = []
    for image, target in val:
        prediction = {"boxes": target["boxes"].as_subclass(torch.Tensor), "labels": target["labels"],
                      "scores": torch.linspace(1, 0.5, len(target["labels"])),
                      "masks": target["masks"][:, None].float() * 0.9}
        results += to_coco_results(target["image_id"], prediction)
    annotations = json.loads(json.dumps(val.coco.dataset["annotations"]))
    metrics = coco_evaluate(val.coco, results, ("bbox", "segm"))
    assert metrics["bbox_AP"] == pytest.approx(100, abs=0.01)
    assert metrics["segm_AP"] == pytest.approx(100, abs=0.01)
    assert val.coco.dataset["annotations"] == annotations  # evaluation left the data alone
    assert torch.equal(val[0][1]["masks"], CocoInstances(root / "val", root / "annotations" /
                                                         "instances_val.json", train=False)[0][1]["masks"])


def test_generated_shapes_are_reproducible_coco_with_exact_masks(tmp_path):
    first = ensure_shapes(tmp_path / "a", num_train=12, num_val=3, size=64, seed=3)
    second = ensure_shapes(tmp_path / "b", num_train=12, num_val=3, size=64, seed=3)
    for split in ("train", "val"):
        a = json.loads((first / "annotations" / f"instances_{split}.json").read_text())
        b = json.loads((second / "annotations" / f"instances_{split}.json").read_text())
        assert a == b
        assert (first / split / "000001.png").read_bytes() == (second / split / "000001.png").read_bytes()
    coco = COCO(str(first / "annotations" / "instances_train.json"))
    assert sorted(coco.getCatIds()) == [1, 2, 3] and len(coco.getImgIds()) == 12
    for ann in coco.loadAnns(coco.getAnnIds()):
        mask = coco.annToMask(ann)
        x, y, w, h = ann["bbox"]
        assert ann["area"] == mask.sum() > 0
        rows, cols = np.nonzero(mask)  # the mask lies within its box
        assert x - 1 <= cols.min() and cols.max() <= x + w and y - 1 <= rows.min() and rows.max() <= y + h
    stamp = (first / "annotations" / "instances_train.json").stat().st_mtime_ns
    ensure_shapes(first, num_train=12, num_val=3, size=64, seed=3)  # already there: kept
    assert (first / "annotations" / "instances_train.json").stat().st_mtime_ns == stamp


def test_a_damaged_or_incomplete_shapes_set_is_refused_or_generated_again(tmp_path):
    """A set is complete once its manifest is written (a kill before it: generated again),
    and checked against it on every open: a changed or missing image is refused, naming the
    file and the command that rebuilds the set."""
    root = ensure_shapes(tmp_path / "shapes", num_train=4, num_val=2, size=64)
    image = root / "train" / "000002.png"
    original = image.read_bytes()
    image.write_bytes(original[:-10] + bytes(10))
    with pytest.raises(ValueError, match=rf"{image} does not hash to the sha256 manifest.json "
                                         rf"records .*rm -r {root} \(the next run generates it"):
        ensure_shapes(root, num_train=4, num_val=2, size=64)
    image.unlink()
    with pytest.raises(ValueError, match=rf"{image} holds None bytes, manifest.json records "
                                         rf"{len(original)}"):
        ensure_shapes(root, num_train=4, num_val=2, size=64)
    (root / "manifest.json").unlink()  # as a kill before the manifest leaves the set
    ensure_shapes(root, num_train=4, num_val=2, size=64)
    assert image.read_bytes() == original


def test_shapes_are_drawn_where_their_masks_say():
    """The rendered pixels inside each mask are the shape's one flat colour."""
    image, instances = render_image(np.random.default_rng(0), 96)
    pixels = np.asarray(image).reshape(-1, 3)
    for instance in instances:
        rle = mask_utils.merge(mask_utils.frPyObjects(instance["segmentation"], 96, 96))
        inside = mask_utils.decode(rle).reshape(-1).astype(bool)
        colours, counts = np.unique(pixels[inside], axis=0, return_counts=True)
        assert counts.max() / inside.sum() > 0.9


def test_missing_coco_root_names_the_fix(tmp_path):
    cfg = config("+exp=mask_rcnn_swin_t_un", f"data.root={tmp_path}/nowhere")
    with pytest.raises(FileNotFoundError, match="UNNORM_COCO"):
        build_datasets(cfg.data, masks=True)
    with pytest.raises(ValueError, match="init_from"):  # full scale starts from ImageNet weights
        train(config("+exp=mask_rcnn_swin_t_un", "logger=none"), tmp_path / "run")


# Every norm in Mask R-CNN (the backbone, the stage-output norms and every head Faster R-CNN
# has, plus the mask head); Faster R-CNN's own configuration with an online and an offline norm.
@pytest.mark.parametrize("norm,model", [*((norm, "mask_rcnn_swin_t") for norm in unnorm.available_norms()),
                                        ("ln", "faster_rcnn_swin_t"), ("un", "faster_rcnn_swin_t")])
def test_every_norm_trains_the_detectors(model, norm, tmp_path, monkeypatch):
    """Two steps of every norm: every loss term of both stages finite and positive;
    detections made, finite, inside the image; every AP field finite; and last.pt, reloaded,
    scores a validation image as the run's evaluation did (its norm state saved)."""
    detections = []  # what each evaluation scored
    scored = trainer.coco_evaluate
    monkeypatch.setattr(trainer, "coco_evaluate", lambda coco, results, *args:
                        detections.append(results) or scored(coco, results, *args))
    result = train(config(f"+exp={model}_{norm}", *QUICK, *_data(tmp_path, val=2)), tmp_path / "run")
    assert result["status"] in FINISHED and result["task"] == "detection" and result["steps"] == 2
    assert result["model"] == model and result["exp_data"] == "shapes" and result["scale"] == "cpu"
    masks = model == "mask_rcnn_swin_t"
    metrics = result["metrics"]
    losses = {"classifier", "box_reg", "objectness", "rpn_box_reg"} | ({"mask"} if masks else set())
    assert {k for k in metrics if k.startswith("train_loss_")} == {f"train_loss_{k}" for k in losses}
    assert all(0 < metrics[f"train_loss_{k}"] < float("inf") for k in losses), metrics
    iou_types = ("bbox", "segm") if masks else ("bbox",)
    assert [k for k in metrics if k.endswith("_AP")] == [f"{kind}_AP" for kind in iou_types]
    assert all(0 <= metrics[f"{kind}_{name}"] <= 100 for kind in iou_types
               for name in ("AP", "AP50", "AP75"))
    [made] = detections
    boxes = torch.tensor([entry["bbox"] for entry in made])
    assert len(made) > 0 and torch.isfinite(boxes).all() and (boxes[:, 2:] >= 0).all()
    assert ((boxes[:, :2] >= 0) & (boxes[:, :2] + boxes[:, 2:] <= 128 + 1e-3)).all()
    saved = json.loads((tmp_path / "run" / "result.json").read_text())
    assert saved["metrics"] == pytest.approx(result["metrics"])

    checkpoint = load_checkpoint(tmp_path / "run" / "last.pt")
    cfg = OmegaConf.create(checkpoint["config"])  # as it ran (PRepBN's hand-over fitted to it)
    _, val_set = build_datasets(cfg.data, masks)
    detector = build_detector(cfg.model, cfg.norm, num_classes=val_set.num_classes)
    detector.load_state_dict(checkpoint["model"])
    norms = [m for m in detector.modules() if isinstance(m, unnorm.ChannelNorm)]
    assert len(norms) == 2 * 8 + 3 + 4 + 1  # 8 blocks x 2, 3 mergings, 4 outputs, patch embed
    assert all(type(m) is type(unnorm.build_norm(norm, 8)) for m in norms)
    image, target = val_set[0]
    with torch.no_grad():
        [prediction] = detector.eval()([image])
    recorded = [entry["score"] for entry in made if entry["image_id"] == target["image_id"]]
    # sorted: near ties may swap under another batch's float rounding, values may not
    np.testing.assert_allclose(sorted(prediction["scores"].tolist()), sorted(recorded),
                               rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["un"])
def test_short_training_beats_an_untrained_detector(norm, tmp_path):
    """192 steps on 192 generated images of 96 px: box AP rises clearly above the untrained
    detector's (which finds nothing: AP ~0; seeds 0 and 1 reached AP 5.6 and 9.0, AP50 17.5
    and 19.3). The committed CPU runs (results/runs/cpu/detection) show every recorded norm
    training further."""
    overrides = ["scale=cpu", "logger=none", "recipe.epochs=8", "recipe.decay_epochs=[7]",
                 "recipe.lr=1e-3", "recipe.warmup_iters=20", "recipe.eval_every=8",
                 *_data(tmp_path, train=192, val=48), "data.generate.size=96",
                 "model.min_size=[96]", "model.max_size=96"]
    cfg = effective_config(config(f"+exp=faster_rcnn_swin_t_{norm}", *overrides))
    torch.manual_seed(0)
    train_set, val_set = build_datasets(cfg.data, masks=False)
    untrained = build_detector(cfg.model, cfg.norm, train_set.num_classes)
    before = evaluate(untrained, val_set, 8, Distributed("cpu"), contextlib.nullcontext, ("bbox",))
    result = train(config(f"+exp=faster_rcnn_swin_t_{norm}", *overrides), tmp_path / "run")
    after = result["metrics"]
    assert result["status"] == "ok" and before["bbox_AP"] < 0.5, before
    assert after["bbox_AP"] > before["bbox_AP"] + 2 and after["bbox_AP50"] > before["bbox_AP50"] + 6, \
        (before, after)


@pytest.mark.slow
def test_resume_after_kill_continues_from_the_saved_epoch(tmp_path):
    want, got = kill_and_resume(["scripts/train.py", "+exp=mask_rcnn_swin_t_un", "scale=cpu",
                                 "logger=none", "recipe.epochs=3", "recipe.eval_every=1",
                                 "scale.max_steps_per_epoch=4", *_data(tmp_path, train=32, val=4)],
                                tmp_path)
    assert got["steps"] == want["steps"] == 12
    for key in ("train_loss", "bbox_AP", "segm_AP"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-4, abs=1e-6), key


def test_ddp_replicas_score_and_save_one_norm_state(tmp_path, monkeypatch):
    """Two gloo replicas with per-replica statistics: both evaluate with one norm state, and
    last.pt evaluated alone, in one process, gives the recorded AP and the detections the
    replicas made on their shards."""
    overrides = ["+exp=faster_rcnn_swin_t_un", *QUICK, *_data(tmp_path, train=16, val=6)]
    _, val_set = build_datasets(effective_config(config(*overrides)).data, masks=False)  # made once
    [replicas] = two_replicas("plugins.torchvision.trainer", [(overrides, tmp_path / "run")],
                              tmp_path / "records")
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] in FINISHED and result["world_size"] == 2
    [first], [second] = (replica["eval"] for replica in replicas)
    assert_states_equal(first["state"], second["state"], "evaluation")

    saved = load_checkpoint(tmp_path / "run" / "last.pt")
    cfg = OmegaConf.create(saved["config"])
    detector = build_detector(cfg.model, cfg.norm, val_set.num_classes)
    detector.load_state_dict(saved["model"])
    alone = []
    scored = trainer.coco_evaluate
    monkeypatch.setattr(trainer, "coco_evaluate", lambda coco, results, *args: alone.append(results)
                        or scored(coco, results, *args))
    metrics = evaluate(detector, val_set, 4, Distributed("cpu"), contextlib.nullcontext, ("bbox",))
    for key, value in metrics.items():
        assert value == pytest.approx(result["metrics"][key], abs=1e-6), key
    [replicated] = first["outputs"]  # every replica's detections, gathered
    assert len(replicated) > 0

    def scores(results):  # per image, sorted: near ties may swap (float noise), values not
        grouped: dict = {}
        for entry in results:
            grouped.setdefault(entry["image_id"], []).append(entry["score"])
        return {image: sorted(values) for image, values in grouped.items()}
    want, got = scores(alone[0]), scores(replicated)
    assert want.keys() == got.keys() == set(val_set.coco.getImgIds())
    for image in want:
        np.testing.assert_allclose(got[image], want[image], rtol=0, atol=1e-5, err_msg=str(image))


def test_evaluation_predicts_the_same_batches_on_any_number_of_replicas(monkeypatch):
    """A batch is padded to its largest image (COCO's sizes vary), so evaluation predicts
    fixed batches of consecutive images, each replica whole batches: on 1, 2 or 3 replicas the
    detector sees the same batches, the last one short."""
    class Images(list):
        coco = None

    class Recorder:  # a detector that names the images of each batch it is given
        def eval(self):
            return self

        def __call__(self, images):
            seen.append(tuple(int(image[0, 0, 0]) for image in images))
            return [{"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long),
                     "scores": torch.zeros(0)} for _ in images]

    class Replica(Distributed):  # replica ``rank`` of ``world``, without a process group
        def __init__(self, rank, world):
            self.rank, self.world, self.device = rank, world, torch.device("cpu")

        def gather(self, obj):
            return [obj]

    monkeypatch.setattr(trainer, "coco_evaluate", lambda coco, results, iou_types: {})
    dataset = Images((torch.full((3, 24 + 8 * i, 40), float(i)), {"image_id": i}) for i in range(7))
    batches = {}
    for world in (1, 2, 3):
        seen = []
        for rank in range(world):
            evaluate(Recorder(), dataset, 3, Replica(rank, world), contextlib.nullcontext, ("bbox",))
        batches[world] = sorted(seen)
    assert batches[1] == [(0, 1, 2), (3, 4, 5), (6,)]
    assert batches[2] == batches[3] == batches[1]


def test_norm_statistics_are_recorded_per_step(tmp_path):
    train(config("+exp=faster_rcnn_swin_t_un", *QUICK, *_data(tmp_path), "record_statistics=true",
                 "collapse.check_every=1"), tmp_path / "run")
    stats = load_checkpoint(tmp_path / "run" / "stats" / "epoch_0001.pt")
    assert "body.layers.0.blocks.0.norm1" in stats and "out_norms.3" in stats
    assert all(next(iter(values.values())).shape[0] == 2 for values in stats.values())  # 2 steps


def test_scale_invariance_is_recorded_from_the_training_losses(tmp_path):
    """record_scale_invariance (on by default) on Faster R-CNN with LN, whose pre-norm blocks
    leave no weight invariant, and Weight Standardization on one block's qkv and on the box
    head's fc6: result.json names those two row-invariant (a standardised layer undoes each
    output row's scale) and every other matrix of the backbone, FPN and heads, plain linear
    layers and convolutions, "none". The probe reads the training losses: the head's fc6 is
    tested too, where the backbone's features would leave it inert. The record is the run
    folder's scale_invariance.json, found on two images."""
    standardized = ["backbone.body.layers.0.blocks.0.attn.qkv", "roi_heads.box_head.fc6"]
    overrides = ["+exp=faster_rcnn_swin_t_ln", *QUICK, *_data(tmp_path),
                 f"model.weight_standardization=[{','.join(standardized)}]"]
    result = train(config(*overrides), tmp_path / "run")
    record = result["scale_invariant"]
    cfg = effective_config(config(*overrides))
    train_set, _ = build_datasets(cfg.data, masks=False)
    matrices = [p for p in build_detector(cfg.model, cfg.norm, train_set.num_classes).parameters()
                if p.ndim >= 2]
    assert record["row"] == sorted(f"{name}.weight" for name in standardized)
    assert record["counts"] == {"row": 2, "tensor": 0, "none": len(matrices) - 2, "inert": 0,
                                "zero": 0}
    assert record["examples"] == DETECTION_PROBE_EXAMPLES == 2
    assert json.loads((tmp_path / "run" / SCALE_INVARIANCE_FILE).read_text()) == record


def test_collapse_is_recorded_as_fail_with_its_step(tmp_path):
    result = train(config("+exp=faster_rcnn_swin_t_nonorm", *QUICK, *_data(tmp_path),
                          "scale.max_steps_per_epoch=10", "recipe.lr=1e8",
                          "recipe.warmup_iters=0", "collapse.check_every=1"), tmp_path / "run")
    saved = json.loads((tmp_path / "run" / "result.json").read_text())
    assert saved["status"] == "FAIL" and saved == result
    assert isinstance(saved["fail_step"], int) and 1 <= saved["fail_step"] <= 10
    assert saved["fail_reason"] and saved["task"] == "detection"


def _warmed_detector(norm: str, masks: bool = True):
    cfg = effective_config(config(f"+exp=mask_rcnn_swin_t_{norm}", "scale=cpu"))
    cfg.model.masks = masks
    if "warmup_iters" in cfg.norm:
        cfg.norm.warmup_iters = 2
    torch.manual_seed(0)
    detector = build_detector(cfg.model, cfg.norm, num_classes=4)
    optimizer = torch.optim.SGD(detector.parameters(), lr=0.01)
    images = [torch.rand(3, 128, 128) for _ in range(2)]
    targets = [{"boxes": torch.tensor([[10.0, 20.0, 60.0, 70.0]]), "labels": torch.tensor([2]),
                "masks": torch.zeros(1, 128, 128, dtype=torch.uint8)} for _ in images]
    for _ in range(6):  # past UN's warm-up, so its statistics are its own
        loss = sum(detector(images, targets).values())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return detector.eval()


@pytest.mark.parametrize("norm", ["un", "bn", "mabn", "pn"])
def test_folded_detector_matches_the_original(norm):
    """A float64 detector, on inputs whose windows get padded: the FPN features change only
    by the float32 rounding of the norms' inference affines, and no norm is left."""
    detector = _warmed_detector(norm).double()
    images = torch.rand(2, 3, 96, 160, dtype=torch.float64)  # stage maps 24x40 ... 3x5
    with torch.no_grad():
        before = detector.backbone(images)
        done = fold_detector(detector, probe=images)
        after = detector.backbone(images)
    assert done == {"folded": 8 + 3 + 4, "affine": 8 + 1, "kept": 0}
    assert not any(isinstance(m, unnorm.ChannelNorm) for m in detector.modules())
    for level in before:
        error = (after[level] - before[level]).abs().max() / before[level].abs().max()
        assert error < 1e-6, (level, error)


def test_fold_plan_names_every_norm_and_refuses_online_norms():
    plan = detector_fold_plan(_warmed_detector("un", masks=False))
    assert plan["backbone.out_norms.0"] == ["backbone.fpn.inner_blocks.0.0"]
    assert plan["backbone.body.layers.1.downsample.norm"] == ["backbone.body.layers.1.downsample.reduction"]
    assert all(not linears for name, linears in plan.items() if name.endswith("norm1"))
    with pytest.raises(ValueError, match="online norm"):
        fold_detector(_warmed_detector("ln", masks=False), probe=None)


def test_fold_script_folds_a_detection_run(tmp_path):
    train(config("+exp=mask_rcnn_swin_t_un", *QUICK, *_data(tmp_path)), tmp_path / "run")
    folded = run_script("scripts/fold.py", str(tmp_path / "run"), "--check-batch", "2")
    assert folded.returncode == 0, folded.stderr[-2000:]
    assert "folded 15 norms into linear layers, 9 into frozen affines" in folded.stdout
    error = float(folded.stdout.split("max relative output change ")[1].split(";")[0])
    assert error < 1e-4
    sys.path.insert(0, str(ROOT / "scripts"))
    from fold import load_folded
    model = load_folded(tmp_path / "run" / "folded.pt")
    assert not any(isinstance(m, unnorm.ChannelNorm) for m in model.modules())
