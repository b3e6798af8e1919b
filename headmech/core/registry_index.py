"""The built-in entries of the registries the command line lists, written by
``headmech.core.index.build_index(write=True)``; do not edit (tests check it
is current)."""

from typing import Any

INDEX: dict[str, dict[str, dict[str, Any]]] = {
    "head_types": {
        "attention_sink": {
            "causal_only": False,
            "citation": "Xiao et al. 2024, Efficient Streaming Language Models with Attention Sinks, ICLR 2024",
            "probe": "prose",
            "reference": "Xiao et al. 2024",
            "summary": "parks a large share of its attention on the first token",
            "task": "lm",
            "threshold": 0.3,
        },
        "concept_induction": {
            "causal_only": True,
            "citation": "Feucht, Todd, Wallace, Bau 2025, The Dual-Route Model of Induction, arXiv:2504.03022",
            "probe": "repeated_words",
            "reference": "Feucht et al. 2025",
            "summary": "attends to the last token of an earlier multi-token word about to be copied",
            "task": "word_copying",
            "threshold": 0.4,
        },
        "concordance": {
            "causal_only": True,
            "citation": "Kamath, Ameisen, Kauvar, Luger, Gurnee, Pearce, Zimmerman, Batson, Conerly, Olah, Lindsey 2025, Tracing Attention Computation Through Feature Interactions, Transformer Circuits Thread; Linzen, Dupoux, Goldberg 2016, Assessing the Ability of LSTMs to Learn Syntax-Sensitive Dependencies, TACL",
            "probe": "agreement",
            "reference": "Kamath et al. 2025",
            "summary": "attends from a verb to the noun that agrees with it in number, subject or attractor",
            "task": "agreement",
            "threshold": 0.1,
        },
        "copy_suppression": {
            "causal_only": True,
            "citation": "McDougall, Conmy, Rushing, McGrath, Nanda 2023, Copy Suppression: Comprehensively Understanding an Attention Head, arXiv:2310.04625",
            "probe": "prose",
            "reference": "McDougall et al. 2023",
            "summary": "lowers the logit of the token it attends to (negative OV circuit on its diagonal)",
            "task": "copy_suppression",
            "threshold": 0.5,
        },
        "cri": {
            "causal_only": True,
            "citation": "LOCOS, arXiv:2607.01002, 2026 (code aryopg/locos, locos/detectors/cri.py: causal retrieval importance, activation patching of each head into a run without the needle)",
            "probe": "documents",
            "reference": "LOCOS 2026 (CRI)",
            "summary": "patched alone into a run without the needle, it restores the answer",
            "task": "documents",
            "threshold": 1.0,
        },
        "duplicate_token": {
            "causal_only": False,
            "citation": "Wang et al. 2022, Interpretability in the Wild: a Circuit for Indirect Object Identification in GPT-2 small, ICLR 2023; TransformerLens head_detector duplicate_token_head",
            "probe": "repeated_random",
            "reference": "Wang et al. 2022",
            "summary": "attends from a token to earlier copies of the same token",
            "task": "induction",
            "threshold": 0.4,
        },
        "function_vector": {
            "causal_only": True,
            "citation": "Todd, Li, Sharma, Mueller, Wallace, Bau 2023, Function Vectors in Large Language Models, arXiv:2310.15213",
            "probe": "icl",
            "reference": "Todd et al. 2023",
            "summary": "its mean output at the query carries an in-context task (antonyms, capitals)",
            "task": "icl",
            "threshold": 0.01,
        },
        "inactive": {
            "causal_only": True,
            "citation": "Sandoval-Segura, Wang, Panda, Goldblum, Basri, Goldstein, Jacobs 2025, Identifying and Evaluating Inactive Heads in Pretrained LLMs, arXiv:2504.03889",
            "probe": "domains",
            "reference": "Sandoval-Segura et al. 2025",
            "summary": "writes almost nothing (small output norm beside its layer) on every domain",
            "task": "lm",
            "threshold": 0.5,
        },
        "induction": {
            "causal_only": True,
            "citation": "Olsson et al. 2022, In-context Learning and Induction Heads, Transformer Circuits Thread",
            "probe": "repeated_random",
            "reference": "Olsson et al. 2022",
            "summary": "attends to the token after an earlier copy of the current token and copies it",
            "task": "induction",
            "threshold": 0.4,
        },
        "locos": {
            "causal_only": True,
            "citation": "LOCOS, arXiv:2607.01002, 2026 (code aryopg/locos: logit contribution of non-literal retrieval heads); Modarressi et al. 2025, NoLiMa: Long-Context Evaluation Beyond Literal Matching, ICML 2025",
            "probe": "documents",
            "reference": "LOCOS 2026",
            "summary": "writes the answer's logit from the needle (the gold document) at the answer step",
            "task": "documents",
            "threshold": 1.0,
        },
        "name_mover": {
            "causal_only": True,
            "citation": "Wang, Variengien, Conmy, Shlegeris, Steinhardt 2022, Interpretability in the Wild: a Circuit for Indirect Object Identification in GPT-2 small, arXiv:2211.00593",
            "probe": "ioi",
            "reference": "Wang et al. 2022",
            "summary": "at the end of an IOI prompt, attends to the indirect object and copies it",
            "task": "ioi",
            "threshold": 0.3,
        },
        "negative_name_mover": {
            "causal_only": True,
            "citation": "Wang, Variengien, Conmy, Shlegeris, Steinhardt 2022, Interpretability in the Wild: a Circuit for Indirect Object Identification in GPT-2 small, arXiv:2211.00593",
            "probe": "ioi",
            "reference": "Wang et al. 2022",
            "summary": "at the end of an IOI prompt, attends to the indirect object and lowers its logit",
            "task": "ioi",
            "threshold": 0.3,
        },
        "positional": {
            "causal_only": False,
            "citation": "Voita, Talbot, Moiseev, Sennrich, Titov 2019, Analyzing Multi-Head Self-Attention: Specialized Heads Do the Heavy Lifting, the Rest Can Be Pruned, ACL",
            "probe": "prose",
            "reference": "Voita et al. 2019",
            "summary": "puts its maximum attention on one fixed relative position (e.g. -1 or +1)",
            "task": "lm",
            "threshold": 0.9,
        },
        "previous_token": {
            "causal_only": False,
            "citation": "Olsson et al. 2022, In-context Learning and Induction Heads, Transformer Circuits Thread; TransformerLens head_detector previous_token_head",
            "probe": "prose",
            "reference": "Olsson et al. 2022",
            "summary": "attends from each token to the token right before it",
            "task": "induction",
            "threshold": 0.5,
        },
        "qrhead": {
            "causal_only": True,
            "citation": "Zhang, Yin, Yen, Chen, Ye 2025, Query-Focused Retrieval Heads Improve Long-Context Reasoning and Re-ranking, EMNLP 2025, arXiv:2506.09944",
            "probe": "query_documents",
            "reference": "Zhang et al. 2025",
            "summary": "its attention from the question goes to the document that answers it",
            "task": "documents",
            "threshold": 0.1,
        },
        "rare_word": {
            "causal_only": False,
            "citation": "Voita, Talbot, Moiseev, Sennrich, Titov 2019, Analyzing Multi-Head Self-Attention: Specialized Heads Do the Heavy Lifting, the Rest Can Be Pruned, ACL",
            "probe": "prose",
            "reference": "Voita et al. 2019",
            "summary": "puts its maximum attention on the least frequent token of the sentence",
            "task": "lm",
            "threshold": 0.3,
        },
        "relation": {
            "causal_only": True,
            "citation": "Chughtai, Cooney, Nanda 2024, Summing Up the Facts: Additive Mechanisms Behind Factual Recall in LLMs, arXiv:2402.07321",
            "probe": "facts",
            "reference": "Chughtai et al. 2024",
            "summary": "writes a fact's answer from the relation's tokens (direct logit attribution)",
            "task": "facts",
            "threshold": 0.25,
        },
        "retrieval": {
            "causal_only": True,
            "citation": "Wu, Wang, Xiao, Peng, Fu 2024, Retrieval Head Mechanistically Explains Long-Context Factuality, arXiv:2404.15574",
            "probe": "needle",
            "reference": "Wu et al. 2024",
            "summary": "copy-pastes the needle's tokens from a long context into the answer",
            "task": "retrieval",
            "threshold": 0.1,
        },
        "s_inhibition": {
            "causal_only": True,
            "citation": "Wang, Variengien, Conmy, Shlegeris, Steinhardt 2022, Interpretability in the Wild: a Circuit for Indirect Object Identification in GPT-2 small, arXiv:2211.00593",
            "probe": "ioi",
            "reference": "Wang et al. 2022",
            "summary": "at the end of an IOI prompt, attends to the repeated subject, below the name movers",
            "task": "ioi",
            "threshold": 0.3,
        },
        "semantic_induction": {
            "causal_only": True,
            "citation": "Ren, Guo, Yan, Liu, Qiu, Lin 2024, Identifying Semantic Induction Heads to Understand In-Context Learning, Findings of ACL 2024, arXiv:2402.13055",
            "probe": "prose",
            "reference": "Ren et al. 2024",
            "summary": "attends to a relation's head word and raises its tail's logit",
            "task": "relation_tail",
            "threshold": 0.5,
        },
        "subject": {
            "causal_only": True,
            "citation": "Chughtai, Cooney, Nanda 2024, Summing Up the Facts: Additive Mechanisms Behind Factual Recall in LLMs, arXiv:2402.07321",
            "probe": "facts",
            "reference": "Chughtai et al. 2024",
            "summary": "writes a fact's answer from the subject's tokens (direct logit attribution)",
            "task": "facts",
            "threshold": 0.25,
        },
        "successor": {
            "causal_only": True,
            "citation": "Gould, Ong, Ogden, Conmy 2023, Successor Heads: Recurring, Interpretable Attention Heads In The Wild, arXiv:2312.09230",
            "probe": "ordinal",
            "reference": "Gould et al. 2023",
            "summary": "maps an ordinal token (Monday, March, C) to its successor through its OV circuit",
            "task": "succession",
            "threshold": 0.4,
        },
        "syntactic": {
            "causal_only": False,
            "citation": "Voita, Talbot, Moiseev, Sennrich, Titov 2019, Analyzing Multi-Head Self-Attention: Specialized Heads Do the Heavy Lifting, the Rest Can Be Pruned, ACL; Clark, Khandelwal, Levy, Manning 2019, What Does BERT Look At? An Analysis of BERT's Attention, BlackboxNLP",
            "probe": "prose",
            "reference": "Voita et al. 2019",
            "summary": "attends from words to their dependency partners more often than position explains",
            "task": "lm",
            "threshold": 0.1,
        },
    },
    "methods": {
        "attribution_patching": {
            "summary": "first-order patching, (z_clean - z_corrupt)·∂metric/∂z"
        },
        "confidence": {"summary": "Voita et al. 2019: mean maximum attention weight"},
        "dla": {"summary": "direct logit attribution through the frozen final norm"},
        "lrp": {"summary": "AttnLRP head relevance (Achtibat et al. 2024)"},
        "mask_gradient": {"summary": "Michel et al. 2019: E|∂L/∂ξ_h| of a mask on each head"},
        "mean": {"summary": "replace each head's output by its mean over the probe"},
        "patching": {
            "summary": "activation patching of each head between clean and corrupted inputs"
        },
        "resample": {
            "summary": "replace each head's output by another input's (the next sequence)"
        },
        "uniform": {
            "summary": "make each head attend uniformly to the keys it may see (Wu et al. 2024)"
        },
        "zero": {"summary": "zero-ablate each head (hook_z = 0) and measure the metric's change"},
    },
    "models": {
        "gemma3-270m": {
            "summary": "Gemma 3 270M (decoder, 18 layers x 4 query heads, 1 KV head, sliding windows, q/k norms, 262k vocabulary), from Q4_K_M GGUF"
        },
        "minilm-l6": {"summary": "all-MiniLM-L6-v2 sentence encoder (BERT, 6 layers x 12 heads)"},
        "qwen2.5-coder-0.5b": {
            "summary": "Qwen2.5-Coder-0.5B-Instruct (Qwen2 decoder, 24 layers x 14 query heads, 2 KV heads, no BOS token), from Q4_K_M GGUF"
        },
        "qwen2.5-coder-1.5b": {
            "summary": "Qwen2.5-Coder-1.5B-Instruct (Qwen2 decoder, 28 layers x 12 query heads, 2 KV heads, no BOS token; 7.1 GB in float32), from Q4_K_M GGUF"
        },
        "smollm2-135m": {
            "summary": "SmolLM2-135M-Instruct (LLaMA decoder, 30 layers x 9 query heads, 3 KV heads), from Q4_1 GGUF"
        },
        "toy-induction": {
            "summary": "2-layer attention-only LLaMA (rotary positions) trained on repeated random tokens (induction heads)"
        },
    },
    "pruning_methods": {
        "l0": {
            "summary": "Voita et al. 2019: Hard Concrete L0 gates distilled to the model, a λ sweep"
        },
        "mae": {
            "summary": "Peng et al. 2020: input-dependent gates over 'all heads but one' vs fine-tuning"
        },
        "michel": {
            "summary": "Michel et al. 2019: drop the 10% least important heads by mask gradient, repeat"
        },
    },
    "tasks": {
        "agreement": {
            "summary": "minus the logit difference of the verb's number across an attractor (decoders)"
        },
        "copy_suppression": {
            "summary": "log-probability of the in-context token the model predicts, on prose (decoders)"
        },
        "documents": {
            "summary": "NLL of the gold document's city after five documents (QRHead's setting; decoders)"
        },
        "facts": {
            "summary": "NLL of a fact's answer after subject and relation (Chughtai et al.; decoders)"
        },
        "icl": {"summary": "answer loss of in-context prompts: antonyms, capitals, ... (decoders)"},
        "induction": {"summary": "loss on the repeated half of random-token sequences"},
        "ioi": {"summary": "minus the logit difference IO - S on IOI prompts (decoders)"},
        "literal": {
            "summary": "NLL of a hidden name asked with the needle's words (nonliteral's control)"
        },
        "lm": {
            "summary": "next-token loss (decoders), 1 - cos of the sentence embedding (encoders)"
        },
        "nonliteral": {
            "summary": "NLL of a hidden name asked without the needle's words (NoLiMa's; decoders)"
        },
        "refusal": {
            "summary": "KL of the reply's first token from the clean model's on refused requests (Ships)"
        },
        "relation_tail": {
            "summary": "loss of dependency tails whose head word came earlier, on prose (decoders)"
        },
        "retrieval": {"summary": "NLL of the needle's answer in a haystack (decoders)"},
        "succession": {"summary": "next-item loss on ordinal sequences (decoders)"},
        "word_copying": {"summary": "loss on the tokens of repeated multi-token words (decoders)"},
    },
}
