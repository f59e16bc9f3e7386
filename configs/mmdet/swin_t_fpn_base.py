# Swin-T + FPN detection on COCO for mmdetection 3.x, as in the Swin detection configs, with
# every backbone norm built by unnorm (plugins/mmdet registers them). Shared by the configs
# beside it; scripts/train.py (model.backend=mmdet) fills norm_cfg, data_root and work_dir.
custom_imports = dict(imports=["plugins.mmdet"], allow_failed_imports=False)
default_scope = "mmdet"

norm_cfg = dict(type="UN", window_size=4, warmup_iters=4000, momentum=0.9,
                outlier_filtration=True)  # UnnormLN, RMS, UnnormBN, MABN, PN, PN_LS, NoNorm, UN,
# DyT, PRepBN. PN_LS's group_num=None: the number of attention heads of each norm's stage.
pretrained = None  # our ImageNet Swin-T of the same norm: python -m plugins.mmdet.convert last.pt out.pth
data_root = "data/coco/"
with_mask = True

model = dict(
    type="MaskRCNN",
    data_preprocessor=dict(type="DetDataPreprocessor", mean=[123.675, 116.28, 103.53],
                           std=[58.395, 57.12, 57.375], bgr_to_rgb=True, pad_mask=True,
                           pad_size_divisor=32),
    backbone=dict(type="UnnormSwinTransformer", embed_dims=96, depths=[2, 2, 6, 2],
                  num_heads=[3, 6, 12, 24], window_size=7, mlp_ratio=4, qkv_bias=True,
                  qk_scale=None, drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.2,
                  patch_norm=True, out_indices=(0, 1, 2, 3), with_cp=False,
                  convert_weights=False, norm_cfg=norm_cfg,
                  init_cfg=dict(type="Pretrained", checkpoint=pretrained) if pretrained else None),
    neck=dict(type="FPN", in_channels=[96, 192, 384, 768], out_channels=256, num_outs=5),
    rpn_head=dict(
        type="RPNHead", in_channels=256, feat_channels=256,
        anchor_generator=dict(type="AnchorGenerator", scales=[8], ratios=[0.5, 1.0, 2.0],
                              strides=[4, 8, 16, 32, 64]),
        bbox_coder=dict(type="DeltaXYWHBBoxCoder", target_means=[0.0, 0.0, 0.0, 0.0],
                        target_stds=[1.0, 1.0, 1.0, 1.0]),
        loss_cls=dict(type="CrossEntropyLoss", use_sigmoid=True, loss_weight=1.0),
        loss_bbox=dict(type="L1Loss", loss_weight=1.0)),
    roi_head=dict(
        type="StandardRoIHead",
        bbox_roi_extractor=dict(type="SingleRoIExtractor",
                                roi_layer=dict(type="RoIAlign", output_size=7, sampling_ratio=0),
                                out_channels=256, featmap_strides=[4, 8, 16, 32]),
        bbox_head=dict(type="Shared2FCBBoxHead", in_channels=256, fc_out_channels=1024,
                       roi_feat_size=7, num_classes=80,
                       bbox_coder=dict(type="DeltaXYWHBBoxCoder", target_means=[0.0, 0.0, 0.0, 0.0],
                                       target_stds=[0.1, 0.1, 0.2, 0.2]),
                       reg_class_agnostic=False,
                       loss_cls=dict(type="CrossEntropyLoss", use_sigmoid=False, loss_weight=1.0),
                       loss_bbox=dict(type="L1Loss", loss_weight=1.0)),
        mask_roi_extractor=dict(type="SingleRoIExtractor",
                                roi_layer=dict(type="RoIAlign", output_size=14, sampling_ratio=0),
                                out_channels=256, featmap_strides=[4, 8, 16, 32]),
        mask_head=dict(type="FCNMaskHead", num_convs=4, in_channels=256, conv_out_channels=256,
                       num_classes=80,
                       loss_mask=dict(type="CrossEntropyLoss", use_mask=True, loss_weight=1.0))),
    train_cfg=dict(
        rpn=dict(assigner=dict(type="MaxIoUAssigner", pos_iou_thr=0.7, neg_iou_thr=0.3,
                               min_pos_iou=0.3, match_low_quality=True, ignore_iof_thr=-1),
                 sampler=dict(type="RandomSampler", num=256, pos_fraction=0.5, neg_pos_ub=-1,
                              add_gt_as_proposals=False),
                 allowed_border=-1, pos_weight=-1, debug=False),
        rpn_proposal=dict(nms_pre=2000, max_per_img=1000, nms=dict(type="nms", iou_threshold=0.7),
                          min_bbox_size=0),
        rcnn=dict(assigner=dict(type="MaxIoUAssigner", pos_iou_thr=0.5, neg_iou_thr=0.5,
                                min_pos_iou=0.5, match_low_quality=True, ignore_iof_thr=-1),
                  sampler=dict(type="RandomSampler", num=512, pos_fraction=0.25, neg_pos_ub=-1,
                               add_gt_as_proposals=True),
                  mask_size=28, pos_weight=-1, debug=False)),
    test_cfg=dict(
        rpn=dict(nms_pre=1000, max_per_img=1000, nms=dict(type="nms", iou_threshold=0.7),
                 min_bbox_size=0),
        rcnn=dict(score_thr=0.05, nms=dict(type="nms", iou_threshold=0.5), max_per_img=100,
                  mask_thr_binary=0.5)))

# Multi-scale training (short side 480-800), with the Swin configs' crop branch.
scales = [(1333, short) for short in range(480, 801, 32)]
train_pipeline = [
    dict(type="LoadImageFromFile"),
    dict(type="LoadAnnotations", with_bbox=True, with_mask=with_mask),
    dict(type="RandomFlip", prob=0.5),
    dict(type="RandomChoice", transforms=[
        [dict(type="RandomChoiceResize", scales=scales, keep_ratio=True)],
        [dict(type="RandomChoiceResize", scales=[(1333, 400), (1333, 500), (1333, 600)],
              keep_ratio=True),
         dict(type="RandomCrop", crop_type="absolute_range", crop_size=(384, 600),
              allow_negative_crop=True),
         dict(type="RandomChoiceResize", scales=scales, keep_ratio=True)]]),
    dict(type="PackDetInputs"),
]
test_pipeline = [
    dict(type="LoadImageFromFile"),
    dict(type="Resize", scale=(1333, 800), keep_ratio=True),
    dict(type="LoadAnnotations", with_bbox=True, with_mask=with_mask),
    dict(type="PackDetInputs", meta_keys=("img_id", "img_path", "ori_shape", "img_shape",
                                          "scale_factor")),
]
train_dataloader = dict(
    batch_size=2, num_workers=2, persistent_workers=True,  # 8 GPUs x 2 = 16
    sampler=dict(type="DefaultSampler", shuffle=True),
    batch_sampler=dict(type="AspectRatioBatchSampler"),
    dataset=dict(type="CocoDataset", data_root=data_root,
                 ann_file="annotations/instances_train2017.json",
                 data_prefix=dict(img="train2017/"),
                 filter_cfg=dict(filter_empty_gt=True, min_size=32), pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=1, num_workers=2, persistent_workers=True, drop_last=False,
    sampler=dict(type="DefaultSampler", shuffle=False),
    dataset=dict(type="CocoDataset", data_root=data_root,
                 ann_file="annotations/instances_val2017.json",
                 data_prefix=dict(img="val2017/"), test_mode=True, pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(type="CocoMetric", ann_file=data_root + "annotations/instances_val2017.json",
                     metric=["bbox", "segm"] if with_mask else ["bbox"], format_only=False)
test_evaluator = val_evaluator

# AdamW 1e-4 at batch 16, wd 0.05 (not on norms or position tables); 3x: 36 epochs.
optim_wrapper = dict(
    type="OptimWrapper",
    optimizer=dict(type="AdamW", lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=dict(custom_keys={"absolute_pos_embed": dict(decay_mult=0.0),
                                    "relative_position_bias_table": dict(decay_mult=0.0),
                                    "norm": dict(decay_mult=0.0)}))
max_epochs = 36
param_scheduler = [
    dict(type="LinearLR", start_factor=0.001, by_epoch=False, begin=0, end=1000),
    dict(type="MultiStepLR", begin=0, end=max_epochs, by_epoch=True, milestones=[27, 33], gamma=0.1),
]
train_cfg = dict(type="EpochBasedTrainLoop", max_epochs=max_epochs, val_interval=1)
val_cfg = dict(type="ValLoop")
test_cfg = dict(type="TestLoop")
auto_scale_lr = dict(enable=False, base_batch_size=16)

default_hooks = dict(timer=dict(type="IterTimerHook"), logger=dict(type="LoggerHook", interval=50),
                     param_scheduler=dict(type="ParamSchedulerHook"),
                     checkpoint=dict(type="CheckpointHook", interval=1, max_keep_ckpts=3),
                     sampler_seed=dict(type="DistSamplerSeedHook"),
                     visualization=dict(type="DetVisualizationHook"))
env_cfg = dict(cudnn_benchmark=False, mp_cfg=dict(mp_start_method="fork", opencv_num_threads=0),
               dist_cfg=dict(backend="nccl"))
# no fixed name: the Runner names it after the run, so that several runs in one process (the
# tests) each get their own rather than mmengine's "has been created" warning
visualizer = dict(type="DetLocalVisualizer", vis_backends=[dict(type="LocalVisBackend")])
log_processor = dict(type="LogProcessor", window_size=50, by_epoch=True)
log_level = "INFO"
load_from = None
resume = False
