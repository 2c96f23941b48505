"""The options `Curvature`, `scale_by_kfac` and `kfac` share are one set.

`CurvatureOptions` defines them (name, default, check, doc); the two
transformations spell them out as keyword arguments, which
``optax.inject_hyperparams`` reads from their signatures. This test holds
the signatures and docstrings to that one definition.
"""

import dataclasses
import inspect

import pytest

import kfac_optax
from kfac_optax._src.curvature import options

FIELDS = dataclasses.fields(kfac_optax.CurvatureOptions)


@pytest.mark.parametrize("factory", [kfac_optax.scale_by_kfac, kfac_optax.kfac,
                                     kfac_optax.Curvature])
def test_every_option_is_an_argument_in_order_with_its_default(factory):
  parameters = inspect.signature(factory).parameters
  listed = [name for name in parameters if name in options.NAMES]
  assert listed == [field.name for field in FIELDS]
  for field in FIELDS:
    assert parameters[field.name].default == field.default, field.name
    assert parameters[field.name].kind == inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("factory", [kfac_optax.scale_by_kfac, kfac_optax.kfac])
def test_every_option_is_documented_once_in_the_docstring(factory):
  doc = factory.__doc__
  assert "{curvature_options}" not in doc
  for field in FIELDS:
    assert doc.count(f"\n    {field.name}: ") == 1, field.name


def test_an_option_reaches_the_curvature_and_is_checked_there():
  with pytest.raises(ValueError, match="ema_decay"):
    kfac_optax.kfac(lambda v, x: x, kfac_optax.losses.squared_error(),
                    example_batch=None, ema_decay=1.0)
