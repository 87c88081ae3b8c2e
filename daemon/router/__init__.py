"""The PD router: one OpenAI API in front of prefill and decode instances (docs/pd.md, docs/router.md).

NOTE: like mtpserve.server, nothing here may import paddle.
"""
