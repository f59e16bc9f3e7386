# Faster R-CNN, Swin-T + FPN, 3x (36 epochs) on COCO: Table 3.
_base_ = ["./swin_t_fpn_base.py"]
model = dict(type="FasterRCNN",
             data_preprocessor=dict(pad_mask=False),
             roi_head=dict(mask_roi_extractor=None, mask_head=None),
             train_cfg=dict(rcnn=dict(mask_size=None)),
             test_cfg=dict(rcnn=dict(mask_thr_binary=None)))
train_pipeline = [
    dict(type="LoadImageFromFile"),
    dict(type="LoadAnnotations", with_bbox=True),
    dict(type="RandomFlip", prob=0.5),
    dict(type="RandomChoice", transforms=[
        [dict(type="RandomChoiceResize", scales={{_base_.scales}}, keep_ratio=True)],
        [dict(type="RandomChoiceResize", scales=[(1333, 400), (1333, 500), (1333, 600)],
              keep_ratio=True),
         dict(type="RandomCrop", crop_type="absolute_range", crop_size=(384, 600),
              allow_negative_crop=True),
         dict(type="RandomChoiceResize", scales={{_base_.scales}}, keep_ratio=True)]]),
    dict(type="PackDetInputs"),
]
test_pipeline = [
    dict(type="LoadImageFromFile"),
    dict(type="Resize", scale=(1333, 800), keep_ratio=True),
    dict(type="LoadAnnotations", with_bbox=True),
    dict(type="PackDetInputs", meta_keys=("img_id", "img_path", "ori_shape", "img_shape",
                                          "scale_factor")),
]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(metric=["bbox"])
test_evaluator = val_evaluator
