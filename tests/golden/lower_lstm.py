# from tvm.script import ir as I
# from tvm.script import tirx as T
# from tvm.tirx.layout import Axis

@I.ir_module
class Module:
    @T.prim_func(s_tir=True)
    def main(x: T.Buffer((6, 8), "float32"), h0: T.Buffer((2, 16), "float32"), c0: T.Buffer((2, 16), "float32"), weight_ih: T.Buffer((64, 8), "float32"), weight_hh: T.Buffer((64, 16), "float32"), bias_ih: T.Buffer((64,), "float32"), bias_hh: T.Buffer((64,), "float32"), h_seq: T.Buffer((8, 16), "float32"), c_seq: T.Buffer((8, 16), "float32")):
        T.func_attr({"tirx.noalias": True})
        # with T.sblock("root"):
        x_proj0 = T.alloc_buffer((6, 64))
        w_packed1 = T.alloc_buffer((16, 64))
        with T.sblock("prologue"):
            T.reads(weight_ih[0:64, 0:8], x[0:6, 0:8], weight_hh[0:64, 0:16], h0[0:2, 0:16], c0[0:2, 0:16])
            T.writes(x_proj0[0:6, 0:64], w_packed1[0:16, 0:64], h_seq[0:2, 0:16], c_seq[0:2, 0:16])
            w_packed0 = T.sblock_alloc_buffer((8, 64))
            h_init = T.match_buffer(h_seq[0:2, 0:16], (2, 16), offset_factor=1)
            c_init = T.match_buffer(c_seq[0:2, 0:16], (2, 16), offset_factor=1)
            for i0, i1 in T.grid(8, 64):
                with T.sblock("w_packed0"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(weight_ih[v_i1, v_i0])
                    T.writes(w_packed0[v_i0, v_i1])
                    w_packed0[v_i0, v_i1] = T.if_then_else(v_i1 < 64, weight_ih[v_i1, v_i0], T.float32(0.0))
            for b, n, k in T.grid(6, 64, 8):
                with T.sblock("x_proj0"):
                    v_b, v_n, v_k = T.axis.remap("SSR", [b, n, k])
                    T.reads(x[v_b, v_k], w_packed0[v_k, v_n])
                    T.writes(x_proj0[v_b, v_n])
                    with T.init():
                        x_proj0[v_b, v_n] = T.float32(0.0)
                    x_proj0[v_b, v_n] = x_proj0[v_b, v_n] + x[v_b, v_k] * w_packed0[v_k, v_n]
            for i0, i1 in T.grid(16, 64):
                with T.sblock("w_packed1"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(weight_hh[v_i1, v_i0])
                    T.writes(w_packed1[v_i0, v_i1])
                    w_packed1[v_i0, v_i1] = T.if_then_else(v_i1 < 64, weight_hh[v_i1, v_i0], T.float32(0.0))
            for i0, i1 in T.grid(2, 16):
                with T.sblock("h_init"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(h0[v_i0, v_i1])
                    T.writes(h_init[v_i0, v_i1])
                    h_init[v_i0, v_i1] = h0[v_i0, v_i1]
            for i0, i1 in T.grid(2, 16):
                with T.sblock("c_init"):
                    v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                    T.reads(c0[v_i0, v_i1])
                    T.writes(c_init[v_i0, v_i1])
                    c_init[v_i0, v_i1] = c0[v_i0, v_i1]
        for t in range(3):
            with T.sblock("step"):
                T.reads(x_proj0[t * 2:t * 2 + 2, 0:64], bias_ih[0:64], h_seq[t * 2:t * 2 + 2, 0:16], w_packed1[0:16, 0:64], bias_hh[0:64], c_seq[t * 2:t * 2 + 2, 0:16])
                T.writes(h_seq[t * 2 + 2:t * 2 + 2 + 2, 0:16], c_seq[t * 2 + 2:t * 2 + 2 + 2, 0:16])
                x_proj0_weight_ih = T.sblock_alloc_buffer((2, 64))
                T_add = T.sblock_alloc_buffer((2, 64))
                gemm0_operand = T.sblock_alloc_buffer((2, 16))
                gemm0 = T.sblock_alloc_buffer((2, 64))
                gemm0_weight_hh = T.sblock_alloc_buffer((2, 64))
                T_add_1 = T.sblock_alloc_buffer((2, 64))
                T_add_2 = T.sblock_alloc_buffer((2, 64))
                T_add_3 = T.sblock_alloc_buffer((2, 16))
                compute = T.sblock_alloc_buffer((2, 16))
                T_add_1_1 = T.sblock_alloc_buffer((2, 16))
                compute_1 = T.sblock_alloc_buffer((2, 16))
                T_multiply = T.sblock_alloc_buffer((2, 16))
                T_add_0 = T.sblock_alloc_buffer((2, 16))
                compute_2 = T.sblock_alloc_buffer((2, 16))
                T_add_2_1 = T.sblock_alloc_buffer((2, 16))
                compute_3 = T.sblock_alloc_buffer((2, 16))
                T_multiply_1 = T.sblock_alloc_buffer((2, 16))
                T_add_4 = T.sblock_alloc_buffer((2, 16))
                compute_4 = T.sblock_alloc_buffer((2, 16))
                T_multiply_2 = T.sblock_alloc_buffer((2, 16))
                x_proj0_t = T.match_buffer(x_proj0[t * 2:t * 2 + 2, 0:64], (2, 64), offset_factor=1)
                h_t = T.match_buffer(h_seq[t * 2:t * 2 + 2, 0:16], (2, 16), offset_factor=1)
                c_t = T.match_buffer(c_seq[t * 2:t * 2 + 2, 0:16], (2, 16), offset_factor=1)
                h_next = T.match_buffer(h_seq[t * 2 + 2:t * 2 + 2 + 2, 0:16], (2, 16), offset_factor=1)
                c_next = T.match_buffer(c_seq[t * 2 + 2:t * 2 + 2 + 2, 0:16], (2, 16), offset_factor=1)
                for b, n in T.grid(2, 64):
                    with T.sblock("x_proj0_weight_ih"):
                        v_b, v_n = T.axis.remap("SS", [b, n])
                        T.reads(x_proj0_t[v_b, v_n])
                        T.writes(x_proj0_weight_ih[v_b, v_n])
                        x_proj0_weight_ih[v_b, v_n] = x_proj0_t[v_b, v_n]
                for ax0, ax1 in T.grid(2, 64):
                    with T.sblock("T_add"):
                        v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                        T.reads(x_proj0_weight_ih[v_ax0, v_ax1], bias_ih[v_ax1])
                        T.writes(T_add[v_ax0, v_ax1])
                        T_add[v_ax0, v_ax1] = x_proj0_weight_ih[v_ax0, v_ax1] + bias_ih[v_ax1]
                for b, k in T.grid(2, 16):
                    with T.sblock("gemm0_operand"):
                        v_b, v_k = T.axis.remap("SS", [b, k])
                        T.reads(h_t[v_b, v_k])
                        T.writes(gemm0_operand[v_b, v_k])
                        gemm0_operand[v_b, v_k] = h_t[v_b, v_k]
                for b, n, k in T.grid(2, 64, 16):
                    with T.sblock("gemm0"):
                        v_b, v_n, v_k = T.axis.remap("SSR", [b, n, k])
                        T.reads(gemm0_operand[v_b, v_k], w_packed1[v_k, v_n])
                        T.writes(gemm0[v_b, v_n])
                        with T.init():
                            gemm0[v_b, v_n] = T.float32(0.0)
                        gemm0[v_b, v_n] = gemm0[v_b, v_n] + gemm0_operand[v_b, v_k] * w_packed1[v_k, v_n]
                for b, n in T.grid(2, 64):
                    with T.sblock("gemm0_weight_hh"):
                        v_b, v_n = T.axis.remap("SS", [b, n])
                        T.reads(gemm0[v_b, v_n])
                        T.writes(gemm0_weight_hh[v_b, v_n])
                        gemm0_weight_hh[v_b, v_n] = gemm0[v_b, v_n]
                for ax0, ax1 in T.grid(2, 64):
                    with T.sblock("T_add_1"):
                        v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                        T.reads(gemm0_weight_hh[v_ax0, v_ax1], bias_hh[v_ax1])
                        T.writes(T_add_1[v_ax0, v_ax1])
                        T_add_1[v_ax0, v_ax1] = gemm0_weight_hh[v_ax0, v_ax1] + bias_hh[v_ax1]
                for ax0, ax1 in T.grid(2, 64):
                    with T.sblock("T_add_2"):
                        v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                        T.reads(T_add[v_ax0, v_ax1], T_add_1[v_ax0, v_ax1])
                        T.writes(T_add_2[v_ax0, v_ax1])
                        T_add_2[v_ax0, v_ax1] = T_add[v_ax0, v_ax1] + T_add_1[v_ax0, v_ax1]
                for i0, i1 in T.grid(2, 16):
                    with T.sblock("T_add_3"):
                        v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                        T.reads(T_add_2[v_i0, v_i1 + 48])
                        T.writes(T_add_3[v_i0, v_i1])
                        T_add_3[v_i0, v_i1] = T_add_2[v_i0, v_i1 + 48]
                for i0, i1 in T.grid(2, 16):
                    with T.sblock("compute"):
                        v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                        T.reads(T_add_3[v_i0, v_i1])
                        T.writes(compute[v_i0, v_i1])
                        compute[v_i0, v_i1] = T.sigmoid(T_add_3[v_i0, v_i1])
                for i0, i1 in T.grid(2, 16):
                    with T.sblock("T_add_1_1"):
                        v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                        T.reads(T_add_2[v_i0, v_i1 + 16])
                        T.writes(T_add_1_1[v_i0, v_i1])
                        T_add_1_1[v_i0, v_i1] = T_add_2[v_i0, v_i1 + 16]
                for i0, i1 in T.grid(2, 16):
                    with T.sblock("compute_1"):
                        v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                        T.reads(T_add_1_1[v_i0, v_i1])
                        T.writes(compute_1[v_i0, v_i1])
                        compute_1[v_i0, v_i1] = T.sigmoid(T_add_1_1[v_i0, v_i1])
                for ax0, ax1 in T.grid(2, 16):
                    with T.sblock("T_multiply"):
                        v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                        T.reads(compute_1[v_ax0, v_ax1], c_t[v_ax0, v_ax1])
                        T.writes(T_multiply[v_ax0, v_ax1])
                        T_multiply[v_ax0, v_ax1] = compute_1[v_ax0, v_ax1] * c_t[v_ax0, v_ax1]
                for i0, i1 in T.grid(2, 16):
                    with T.sblock("T_add_0"):
                        v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                        T.reads(T_add_2[v_i0, v_i1])
                        T.writes(T_add_0[v_i0, v_i1])
                        T_add_0[v_i0, v_i1] = T_add_2[v_i0, v_i1]
                for i0, i1 in T.grid(2, 16):
                    with T.sblock("compute_2"):
                        v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                        T.reads(T_add_0[v_i0, v_i1])
                        T.writes(compute_2[v_i0, v_i1])
                        compute_2[v_i0, v_i1] = T.sigmoid(T_add_0[v_i0, v_i1])
                for i0, i1 in T.grid(2, 16):
                    with T.sblock("T_add_2_1"):
                        v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                        T.reads(T_add_2[v_i0, v_i1 + 32])
                        T.writes(T_add_2_1[v_i0, v_i1])
                        T_add_2_1[v_i0, v_i1] = T_add_2[v_i0, v_i1 + 32]
                for i0, i1 in T.grid(2, 16):
                    with T.sblock("compute_3"):
                        v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                        T.reads(T_add_2_1[v_i0, v_i1])
                        T.writes(compute_3[v_i0, v_i1])
                        compute_3[v_i0, v_i1] = T.tanh(T_add_2_1[v_i0, v_i1])
                for ax0, ax1 in T.grid(2, 16):
                    with T.sblock("T_multiply_1"):
                        v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                        T.reads(compute_2[v_ax0, v_ax1], compute_3[v_ax0, v_ax1])
                        T.writes(T_multiply_1[v_ax0, v_ax1])
                        T_multiply_1[v_ax0, v_ax1] = compute_2[v_ax0, v_ax1] * compute_3[v_ax0, v_ax1]
                for ax0, ax1 in T.grid(2, 16):
                    with T.sblock("T_add_4"):
                        v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                        T.reads(T_multiply[v_ax0, v_ax1], T_multiply_1[v_ax0, v_ax1])
                        T.writes(T_add_4[v_ax0, v_ax1])
                        T_add_4[v_ax0, v_ax1] = T_multiply[v_ax0, v_ax1] + T_multiply_1[v_ax0, v_ax1]
                for i0, i1 in T.grid(2, 16):
                    with T.sblock("compute_4"):
                        v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                        T.reads(T_add_4[v_i0, v_i1])
                        T.writes(compute_4[v_i0, v_i1])
                        compute_4[v_i0, v_i1] = T.tanh(T_add_4[v_i0, v_i1])
                for ax0, ax1 in T.grid(2, 16):
                    with T.sblock("T_multiply_2"):
                        v_ax0, v_ax1 = T.axis.remap("SS", [ax0, ax1])
                        T.reads(compute[v_ax0, v_ax1], compute_4[v_ax0, v_ax1])
                        T.writes(T_multiply_2[v_ax0, v_ax1])
                        T_multiply_2[v_ax0, v_ax1] = compute[v_ax0, v_ax1] * compute_4[v_ax0, v_ax1]
                for i0, i1 in T.grid(2, 16):
                    with T.sblock("h_next"):
                        v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                        T.reads(T_multiply_2[v_i0, v_i1])
                        T.writes(h_next[v_i0, v_i1])
                        h_next[v_i0, v_i1] = T_multiply_2[v_i0, v_i1]
                for i0, i1 in T.grid(2, 16):
                    with T.sblock("c_next"):
                        v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
                        T.reads(T_add_4[v_i0, v_i1])
                        T.writes(c_next[v_i0, v_i1])
                        c_next[v_i0, v_i1] = T_add_4[v_i0, v_i1]
