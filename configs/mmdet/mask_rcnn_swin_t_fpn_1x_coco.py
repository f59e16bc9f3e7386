# Mask R-CNN, Swin-T + FPN, 1x (12 epochs, lr x0.1 at 8 and 11) on COCO: the ablations.
_base_ = ["./swin_t_fpn_base.py"]
max_epochs = 12
param_scheduler = [
    dict(type="LinearLR", start_factor=0.001, by_epoch=False, begin=0, end=1000),
    dict(type="MultiStepLR", begin=0, end=12, by_epoch=True, milestones=[8, 11], gamma=0.1),
]
train_cfg = dict(max_epochs=12)
