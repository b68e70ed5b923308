"""rfdetr's model on whole static batches: building it, the on-device matching, the loss, masks, weight files and
export."""
