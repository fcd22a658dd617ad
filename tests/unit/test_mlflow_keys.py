"""What MLflow is sent of a metrics row (tracking.for_mlflow): no second chart of the loss."""

from pipeline.train.tracking import for_mlflow


def test_an_objectives_only_loss_term_and_its_perplexity_are_not_sent_again():
    row = {"loss": 2.5, "mlm_loss": 2.5, "mlm_acc": 0.25, "step_loss": 2.4, "lr": 1e-3,
           "eval_loss": 3.0, "eval_mlm_loss": 3.0, "eval_ppl": 20.1, "eval_mlm_ppl": 20.1,
           "eval_mlm_acc": 0.2}  # fmt: skip
    assert set(for_mlflow(row)) == {"loss", "mlm_acc", "lr", "eval_loss", "eval_ppl",
                                    "eval_mlm_acc"}  # fmt: skip


def test_terms_of_an_objective_of_several_are_all_sent():
    row = {"loss": 3.0, "mlm_loss": 2.5, "nsp_loss": 0.5, "eval_loss": 3.2,
           "eval_mlm_loss": 2.6, "eval_nsp_loss": 0.6, "eval_mlm_ppl": 13.5}  # fmt: skip
    assert set(for_mlflow(row)) == set(row)


def test_a_single_term_that_differs_from_the_loss_is_sent():
    """A term weighted into the loss is not the loss: it keeps its chart."""
    assert set(for_mlflow({"loss": 1.0, "lm_loss": 2.0})) == {"loss", "lm_loss"}
