"""Built-in environments, by config name -> ``module:Class`` (imported only when used)."""

BUILTINS: dict[str, str] = {
    "countdown": "refractor.envs.builtin.countdown:CountdownEnvironment",
    "hendrycks_math": "refractor.envs.builtin.math_problems:HendrycksMathEnvironment",
    "dapo_math": "refractor.envs.builtin.math_problems:DapoMathEnvironment",
    "deepscaler": "refractor.envs.builtin.math_problems:DeepScalerEnvironment",
    "wordle": "refractor.envs.builtin.wordle:WordleEnvironment",
    "code": "refractor.envs.builtin.code:CodeEnvironment",
    "i3_code": "refractor.envs.builtin.code:I3CodeEnvironment",
    "calculator_tools": "refractor.envs.builtin.calculator_tools:CalculatorToolsEnvironment",
    "target_copy": "refractor.envs.builtin.target_copy:TargetCopyEnvironment",
}
