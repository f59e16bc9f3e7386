# Mask R-CNN, Swin-T + FPN, 3x (36 epochs) on COCO: Table 4.
_base_ = ["./swin_t_fpn_base.py"]
