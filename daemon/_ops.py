from paddle import _C_ops
from paddle.framework import in_dynamic_or_pir_mode
from paddle.base.layer_helper import LayerHelper
from paddle.jit.marker import unified

@unified
def mtp_output_control(x,code,message,step_id,instance_tag,rank_id,send_rank,transport,queue,sysv_key,ring,max_msg_bytes,max_pending_bytes,chunked):
    # The output variable's dtype use default value 'float32',
    # and the actual dtype of output variable will be inferred in runtime.
    if in_dynamic_or_pir_mode():
        outs = _C_ops._run_custom_op("mtp_output_control", x,code,message,step_id,instance_tag,rank_id,send_rank,transport,queue,sysv_key,ring,max_msg_bytes,max_pending_bytes,chunked)
        res = []
        start_idx = 0
        res.append(outs[start_idx])
        start_idx += 1
        return res[0] if len(res)==1 else res
    else:
        ins = {}
        ins_map = {'x' : x}
        outs = {}
        outs_list = ['status']
        for key, value in ins_map.items():
            # handle optional inputs
            if value is not None:
                ins[key] = value
        helper = LayerHelper("mtp_output_control", **locals())

        outs['status'] = helper.create_variable(dtype='float32')
        helper.append_op(type="mtp_output_control", inputs=ins, outputs=outs, attrs={'code' : code,'message' : message,'step_id' : step_id,'instance_tag' : instance_tag,'rank_id' : rank_id,'send_rank' : send_rank,'transport' : transport,'queue' : queue,'sysv_key' : sysv_key,'ring' : ring,'max_msg_bytes' : max_msg_bytes,'max_pending_bytes' : max_pending_bytes,'chunked' : chunked})
        res = [outs[out_name] if out_name in outs.keys() else None for out_name in outs_list]
        return res[0] if len(res)==1 else res


from paddle import _C_ops
from paddle.framework import in_dynamic_or_pir_mode
from paddle.base.layer_helper import LayerHelper
from paddle.jit.marker import unified

@unified
def mtp_output_send_first_token(req_ids,seq,finish,token_ids,logprob,rank,topk_ids,topk_logprobs,draft_ids,step_id,num_topk,vocab_size,instance_tag,rank_id,send_rank,transport,queue,sysv_key,ring,max_msg_bytes,max_pending_bytes,chunked):
    # The output variable's dtype use default value 'float32',
    # and the actual dtype of output variable will be inferred in runtime.
    if in_dynamic_or_pir_mode():
        outs = _C_ops._run_custom_op("mtp_output_send_first_token", req_ids,seq,finish,token_ids,logprob,rank,topk_ids,topk_logprobs,draft_ids,step_id,num_topk,vocab_size,instance_tag,rank_id,send_rank,transport,queue,sysv_key,ring,max_msg_bytes,max_pending_bytes,chunked)
        res = []
        start_idx = 0
        res.append(outs[start_idx])
        start_idx += 1
        return res[0] if len(res)==1 else res
    else:
        ins = {}
        ins_map = {'req_ids' : req_ids,'seq' : seq,'finish' : finish,'token_ids' : token_ids,'logprob@OPTIONAL' : logprob,'rank@OPTIONAL' : rank,'topk_ids@OPTIONAL' : topk_ids,'topk_logprobs@OPTIONAL' : topk_logprobs,'draft_ids@OPTIONAL' : draft_ids}
        outs = {}
        outs_list = ['status']
        for key, value in ins_map.items():
            # handle optional inputs
            if value is not None:
                ins[key] = value
        helper = LayerHelper("mtp_output_send_first_token", **locals())

        outs['status'] = helper.create_variable(dtype='float32')
        helper.append_op(type="mtp_output_send_first_token", inputs=ins, outputs=outs, attrs={'step_id' : step_id,'num_topk' : num_topk,'vocab_size' : vocab_size,'instance_tag' : instance_tag,'rank_id' : rank_id,'send_rank' : send_rank,'transport' : transport,'queue' : queue,'sysv_key' : sysv_key,'ring' : ring,'max_msg_bytes' : max_msg_bytes,'max_pending_bytes' : max_pending_bytes,'chunked' : chunked})
        res = [outs[out_name] if out_name in outs.keys() else None for out_name in outs_list]
        return res[0] if len(res)==1 else res


from paddle import _C_ops
from paddle.framework import in_dynamic_or_pir_mode
from paddle.base.layer_helper import LayerHelper
from paddle.jit.marker import unified

@unified
def mtp_output_pack(req_ids,seq,num_tokens,finish,token_ids,logprob,rank,topk_ids,topk_logprobs,draft_ids,kind,step_id,num_topk,vocab_size,instance_tag):
    # The output variable's dtype use default value 'float32',
    # and the actual dtype of output variable will be inferred in runtime.
    if in_dynamic_or_pir_mode():
        outs = _C_ops._run_custom_op("mtp_output_pack", req_ids,seq,num_tokens,finish,token_ids,logprob,rank,topk_ids,topk_logprobs,draft_ids,kind,step_id,num_topk,vocab_size,instance_tag)
        res = []
        start_idx = 0
        res.append(outs[start_idx])
        start_idx += 1
        return res[0] if len(res)==1 else res
    else:
        ins = {}
        ins_map = {'req_ids' : req_ids,'seq' : seq,'num_tokens' : num_tokens,'finish' : finish,'token_ids' : token_ids,'logprob@OPTIONAL' : logprob,'rank@OPTIONAL' : rank,'topk_ids@OPTIONAL' : topk_ids,'topk_logprobs@OPTIONAL' : topk_logprobs,'draft_ids@OPTIONAL' : draft_ids}
        outs = {}
        outs_list = ['frame']
        for key, value in ins_map.items():
            # handle optional inputs
            if value is not None:
                ins[key] = value
        helper = LayerHelper("mtp_output_pack", **locals())

        outs['frame'] = helper.create_variable(dtype='float32')
        helper.append_op(type="mtp_output_pack", inputs=ins, outputs=outs, attrs={'kind' : kind,'step_id' : step_id,'num_topk' : num_topk,'vocab_size' : vocab_size,'instance_tag' : instance_tag})
        res = [outs[out_name] if out_name in outs.keys() else None for out_name in outs_list]
        return res[0] if len(res)==1 else res


from paddle import _C_ops
from paddle.framework import in_dynamic_or_pir_mode
from paddle.base.layer_helper import LayerHelper
from paddle.jit.marker import unified

@unified
def mtp_output_close(x,ring):
    # The output variable's dtype use default value 'float32',
    # and the actual dtype of output variable will be inferred in runtime.
    if in_dynamic_or_pir_mode():
        outs = _C_ops._run_custom_op("mtp_output_close", x,ring)
        res = []
        start_idx = 0
        res.append(outs[start_idx])
        start_idx += 1
        return res[0] if len(res)==1 else res
    else:
        ins = {}
        ins_map = {'x' : x}
        outs = {}
        outs_list = ['status']
        for key, value in ins_map.items():
            # handle optional inputs
            if value is not None:
                ins[key] = value
        helper = LayerHelper("mtp_output_close", **locals())

        outs['status'] = helper.create_variable(dtype='float32')
        helper.append_op(type="mtp_output_close", inputs=ins, outputs=outs, attrs={'ring' : ring})
        res = [outs[out_name] if out_name in outs.keys() else None for out_name in outs_list]
        return res[0] if len(res)==1 else res


from paddle import _C_ops
from paddle.framework import in_dynamic_or_pir_mode
from paddle.base.layer_helper import LayerHelper
from paddle.jit.marker import unified

@unified
def mtp_output_flush(x,rank_id,send_rank,transport,queue,sysv_key,ring,max_msg_bytes,max_pending_bytes,chunked):
    # The output variable's dtype use default value 'float32',
    # and the actual dtype of output variable will be inferred in runtime.
    if in_dynamic_or_pir_mode():
        outs = _C_ops._run_custom_op("mtp_output_flush", x,rank_id,send_rank,transport,queue,sysv_key,ring,max_msg_bytes,max_pending_bytes,chunked)
        res = []
        start_idx = 0
        res.append(outs[start_idx])
        start_idx += 1
        return res[0] if len(res)==1 else res
    else:
        ins = {}
        ins_map = {'x' : x}
        outs = {}
        outs_list = ['status']
        for key, value in ins_map.items():
            # handle optional inputs
            if value is not None:
                ins[key] = value
        helper = LayerHelper("mtp_output_flush", **locals())

        outs['status'] = helper.create_variable(dtype='float32')
        helper.append_op(type="mtp_output_flush", inputs=ins, outputs=outs, attrs={'rank_id' : rank_id,'send_rank' : send_rank,'transport' : transport,'queue' : queue,'sysv_key' : sysv_key,'ring' : ring,'max_msg_bytes' : max_msg_bytes,'max_pending_bytes' : max_pending_bytes,'chunked' : chunked})
        res = [outs[out_name] if out_name in outs.keys() else None for out_name in outs_list]
        return res[0] if len(res)==1 else res


from paddle import _C_ops
from paddle.framework import in_dynamic_or_pir_mode
from paddle.base.layer_helper import LayerHelper
from paddle.jit.marker import unified

@unified
def mtp_output_send(req_ids,seq,num_tokens,finish,token_ids,logprob,rank,topk_ids,topk_logprobs,draft_ids,kind,step_id,num_topk,vocab_size,instance_tag,rank_id,send_rank,transport,queue,sysv_key,ring,max_msg_bytes,max_pending_bytes,chunked):
    # The output variable's dtype use default value 'float32',
    # and the actual dtype of output variable will be inferred in runtime.
    if in_dynamic_or_pir_mode():
        outs = _C_ops._run_custom_op("mtp_output_send", req_ids,seq,num_tokens,finish,token_ids,logprob,rank,topk_ids,topk_logprobs,draft_ids,kind,step_id,num_topk,vocab_size,instance_tag,rank_id,send_rank,transport,queue,sysv_key,ring,max_msg_bytes,max_pending_bytes,chunked)
        res = []
        start_idx = 0
        res.append(outs[start_idx])
        start_idx += 1
        return res[0] if len(res)==1 else res
    else:
        ins = {}
        ins_map = {'req_ids' : req_ids,'seq' : seq,'num_tokens' : num_tokens,'finish' : finish,'token_ids' : token_ids,'logprob@OPTIONAL' : logprob,'rank@OPTIONAL' : rank,'topk_ids@OPTIONAL' : topk_ids,'topk_logprobs@OPTIONAL' : topk_logprobs,'draft_ids@OPTIONAL' : draft_ids}
        outs = {}
        outs_list = ['status']
        for key, value in ins_map.items():
            # handle optional inputs
            if value is not None:
                ins[key] = value
        helper = LayerHelper("mtp_output_send", **locals())

        outs['status'] = helper.create_variable(dtype='float32')
        helper.append_op(type="mtp_output_send", inputs=ins, outputs=outs, attrs={'kind' : kind,'step_id' : step_id,'num_topk' : num_topk,'vocab_size' : vocab_size,'instance_tag' : instance_tag,'rank_id' : rank_id,'send_rank' : send_rank,'transport' : transport,'queue' : queue,'sysv_key' : sysv_key,'ring' : ring,'max_msg_bytes' : max_msg_bytes,'max_pending_bytes' : max_pending_bytes,'chunked' : chunked})
        res = [outs[out_name] if out_name in outs.keys() else None for out_name in outs_list]
        return res[0] if len(res)==1 else res


import os
import sys
import types
import paddle
import importlib.abc
import importlib.util

cur_dir = os.path.dirname(os.path.abspath(__file__))
so_path = os.path.join(cur_dir, "_ops_pd_.so")

def __bootstrap__():
    assert os.path.exists(so_path)
    # load custom op shared library with abs path
    custom_ops = paddle.utils.cpp_extension.load_op_meta_info_and_register_op(so_path)

    if os.name == 'nt' or sys.platform.startswith('darwin'):
        # Cpp Extension only support Linux now
        mod = types.ModuleType(__name__)
    else:
        try:
            spec = importlib.util.spec_from_file_location(__name__, so_path)
            assert spec is not None
            mod = importlib.util.module_from_spec(spec)
            assert isinstance(spec.loader, importlib.abc.Loader)
            spec.loader.exec_module(mod)
        except ImportError:
            mod = types.ModuleType(__name__)

    for custom_op in custom_ops:
        setattr(mod, custom_op, eval(custom_op))

__bootstrap__()

